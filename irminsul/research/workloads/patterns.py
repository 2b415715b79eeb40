"""Workload patterns: real requests rewritten into the paper's agentic patterns (§5 table).

Each generator takes the requests of a source, in arrival order, and returns new ones; it is
seeded (`random.Random(seed)`, nothing global) and its knobs are keyword arguments.

- `agent_meta`: a varying agent-metadata header at the very start of every request.
- `sysvar`: system-prompt variants that differ in the middle.
- `compact`: older turns of a session replaced by a summary once the history grows.
- `rerank`: the same retrieved passages again, in another order and subset.
- `tool_variants`: other subsets and orders of the same tool schemas.
- `skewed`: multi-session RAG whose sessions' sizes are heavy-tailed: a few hot sessions carry
  most of the requests, interleaved with many small ones.
- `raw`: the source as it is.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

from irminsul.errors import UserFacingError
from irminsul.research.workloads.trace import TraceRequest

AGENTS = ("airline-support", "booking-assistant", "triage-bot", "travel-concierge", "ops-copilot")
PROFILE_FIELDS = (
    "preferred_language: {lang}",
    "loyalty_tier: {tier}",
    "home_airport: {airport}",
    "timezone: {tz}",
    "seat_preference: {seat}",
    "accessibility_needs: {need}",
    "last_contact: {days} days ago",
    "open_tickets: {n}",
    "lifetime_bookings: {big}",
    "marketing_opt_in: {flag}",
    "note: customer asked about {topic} on a previous call",
    "device: {device}",
    "channel: {channel}",
)
FILL = {
    "lang": ("en", "de", "fr", "es", "ja", "zh"),
    "tier": ("none", "silver", "gold", "platinum"),
    "airport": ("JFK", "SFO", "ORD", "SEA", "MUC", "LHR"),
    "tz": ("America/New_York", "Europe/Berlin"),
    "seat": ("aisle", "window", "none"),
    "need": ("none", "wheelchair", "extra legroom"),
    "flag": ("true", "false"),
    "device": ("ios", "android", "web"),
    "channel": ("chat", "voice", "email"),
    "topic": ("baggage allowance", "refund status", "seat upgrades", "travel insurance", "pet policy"),
}
VARIANT_LINES = (
    "Escalate to a human agent when the user mentions a legal claim.",
    "Today's service notice: flights through {airport} may be delayed by weather.",
    "Offer the {tier} lounge voucher only after the booking is confirmed.",
    "Answer in the user's preferred language ({lang}) when it is known.",
    "Refunds above ${n}00 need a supervisor's approval code.",
    "Do not discuss {topic} unless the user raises it first.",
    "This deployment serves the {channel} channel; keep answers short.",
)


def _fill(rng: random.Random, template: str) -> str:
    return template.format(
        **{k: rng.choice(v) for k, v in FILL.items()},
        days=rng.randint(1, 400),
        n=rng.randint(1, 9),
        big=rng.randint(1, 900),
    )


def _split_system(r: TraceRequest) -> tuple[list[dict], list[dict]]:
    msgs = list(r.messages)
    n = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    return msgs[:n], msgs[n:]


def raw(requests: list[TraceRequest], seed: int = 0) -> list[TraceRequest]:
    return list(requests)


def agent_meta(
    requests: list[TraceRequest], seed: int = 0, profile_lines: tuple[int, int] = (2, 24)
) -> list[TraceRequest]:
    """Prepend a header message (request id, timestamp, agent, user profile of varying length)."""
    rng = random.Random(seed)
    clock = datetime(2026, 5, 4, 9, 0, 0)
    out = []
    for r in requests:
        clock += timedelta(seconds=rng.randint(1, 90), milliseconds=rng.randint(0, 999))
        lines = [
            f"request_id: req-{rng.getrandbits(64):016x}",
            f"timestamp: {clock.isoformat(timespec='milliseconds')}Z",
            f"agent: {rng.choice(AGENTS)}",
            "user_profile:",
        ]
        lines += ["  " + _fill(rng, rng.choice(PROFILE_FIELDS)) for _ in range(rng.randint(*profile_lines))]
        header = {"role": "system", "content": "<agent-metadata>\n" + "\n".join(lines) + "\n</agent-metadata>"}
        out.append(replace(r, messages=(header, *r.messages)))
    return out


def sysvar(
    requests: list[TraceRequest],
    seed: int = 0,
    n_variants: int = 8,
    per: str = "request",
    lines: tuple[int, int] = (1, 6),
    at: float = 0.5,
) -> list[TraceRequest]:
    """Insert one of `n_variants` paragraphs (of 1-6 lines) at fraction `at` of the system prompt's
    paragraphs; a variant is drawn per request (a dynamic section) or per session."""
    rng = random.Random(seed)
    variants = [
        "\n".join(_fill(rng, rng.choice(VARIANT_LINES)) for _ in range(rng.randint(*lines))) for _ in range(n_variants)
    ]
    chosen: dict[str, str] = {}
    out = []
    for r in requests:
        system, rest = _split_system(r)
        if not system:
            raise UserFacingError("sysvar needs requests with a system prompt (tau_bench, toolbench, musique)")
        if per == "session":
            variant = chosen.setdefault(r.session, rng.choice(variants))
        else:
            variant = rng.choice(variants)
        text = system[-1].get("content") or ""
        sep = next((s for s in ("\n\n", "\n", ". ") if text.count(s) >= 2), "\n\n")
        pieces = text.split(sep)
        cut = max(1, round(at * len(pieces)))
        content = sep.join(pieces[:cut] + ["## Deployment notes\n" + variant + "\n"] + pieces[cut:])
        out.append(replace(r, messages=(*system[:-1], {**system[-1], "content": content}, *rest)))
    return out


def _summary(messages: list[dict]) -> str:
    lines = []
    for m in messages:
        text = m.get("content") if isinstance(m.get("content"), str) else ""
        calls = [c.get("function", c).get("name", "") for c in m.get("tool_calls") or []]
        text = " ".join((text or "").split()[:20]) or ("called " + ", ".join(calls) if calls else "(no text)")
        lines.append(f"- {m['role']}: {text}")
    return "Summary of the earlier conversation:\n" + "\n".join(lines)


def compact(
    requests: list[TraceRequest], seed: int = 0, every: tuple[int, int] = (4, 8), keep_last: int = 2
) -> list[TraceRequest]:
    """Once a session's history beyond its last summary exceeds `every` (drawn per compaction)
    plus `keep_last` messages, all but the last `keep_last` are replaced by a summary message."""
    rng = random.Random(seed)
    state: dict[str, tuple[int, list[dict], int]] = {}  # session -> (cut, summarised, trigger)
    out, compacted = [], 0
    for r in requests:
        system, body = _split_system(r)
        cut, summarised, trigger = state.get(r.session, (0, [], rng.randint(*every)))
        if len(body) - cut > trigger + keep_last:
            new_cut = len(body) - keep_last
            summarised = summarised + body[cut:new_cut]
            cut, trigger, compacted = new_cut, rng.randint(*every), compacted + 1
        state[r.session] = (cut, summarised, trigger)
        head = [{"role": "user", "content": _summary(summarised)}] if summarised else []
        out.append(replace(r, messages=(*system, *head, *body[cut:])))
    if not compacted:
        raise UserFacingError(
            "compact found no session long enough to compact: use a multi-turn source (tau_bench, toolbench, bfcl)"
        )
    return out


def rerank(
    requests: list[TraceRequest], seed: int = 0, repeats: int = 4, keep: tuple[float, float] = (0.6, 1.0)
) -> list[TraceRequest]:
    """After each RAG request, `repeats` more with its passages (all text parts of a message but the
    last, which is the question) re-ordered and a random subset of `keep` of them kept."""
    rng = random.Random(seed)
    out = []
    for r in requests:
        idx = next((i for i, m in enumerate(r.messages) if isinstance(m.get("content"), list)), None)
        if idx is None:
            raise UserFacingError("rerank needs requests with retrieved passages as text parts (musique)")
        out.append(r)
        m = r.messages[idx]
        passages, question = m["content"][:-1], m["content"][-1:]
        for _ in range(repeats):
            subset = rng.sample(passages, max(1, round(rng.uniform(*keep) * len(passages))))
            msg = {**m, "content": subset + question}
            out.append(replace(r, messages=(*r.messages[:idx], msg, *r.messages[idx + 1 :])))
    return out


def tool_variants(
    requests: list[TraceRequest], seed: int = 0, keep: tuple[float, float] = (0.5, 1.0), per: str = "request"
) -> list[TraceRequest]:
    """Each request (or session) gets a random subset of `keep` of its tools, in a random order."""
    rng = random.Random(seed)
    chosen: dict[str, list[int]] = {}
    out = []
    for r in requests:
        if not r.tools:
            raise UserFacingError("tool_variants needs requests with tools (tau_bench, bfcl, toolbench)")
        n = len(r.tools)
        order = rng.sample(range(n), max(1, round(rng.uniform(*keep) * n)))
        if per == "session":
            order = chosen.setdefault(r.session, order)
        out.append(replace(r, tools=tuple(r.tools[i] for i in order if i < n)))
    return out


def skewed(
    requests: list[TraceRequest],
    seed: int = 0,
    per_source: int = 4,
    zipf: float = 1.2,
    new_passages: tuple[int, int] = (1, 3),
    keep_turns: int = 2,
) -> list[TraceRequest]:
    """Multi-turn RAG sessions whose sizes follow a heavy tail. Each source RAG request opens a
    session; `per_source` x sources requests follow, each a turn of a session drawn with probability
    proportional to 1 / rank ** `zipf` (ranks shuffled, so the hot sessions interleave with the rest
    throughout). A turn retrieves `new_passages` passages new to its session (drawn from all the
    source's passages) and asks a source question; the prompt carries the session's last
    `keep_turns` turns (their passages, questions and a stand-in answer) before it. Passages are dealt
    from the source's, shuffled, without repeats until every one has been dealt: reuse comes from the
    sessions' own history, not from passages recurring by chance."""
    rng = random.Random(seed)
    sources, passages, qa = [], [], []
    for r in requests:
        idx = next((i for i, m in enumerate(r.messages) if isinstance(m.get("content"), list)), None)
        if idx is None:
            raise UserFacingError("skewed needs requests with retrieved passages as text parts (musique)")
        sources.append((r, idx))
        passages += r.messages[idx]["content"][:-1]
        qa.append(r.messages[idx]["content"][-1])
    if not sources:
        return []
    ranks = list(range(len(sources)))
    rng.shuffle(ranks)
    weights = [1 / (ranks[s] + 1) ** zipf for s in range(len(sources))]
    history: dict[int, list[dict]] = {}  # session -> its turns' messages so far
    deck: list[dict] = []
    out = []
    for s in rng.choices(range(len(sources)), weights, k=per_source * len(sources)):
        r, idx = sources[s]
        turns = history.setdefault(s, [])
        question = rng.randrange(len(qa))
        dealt = []
        for _ in range(rng.randint(*new_passages)):
            if not deck:
                deck = rng.sample(passages, len(passages))
            dealt.append(deck.pop())
        turn = {**r.messages[idx], "content": dealt + [qa[question]]}
        kept = turns[-2 * keep_turns :] if keep_turns else []
        out.append(replace(r, session=f"skewed-{s}", messages=(*r.messages[:idx], *kept, turn)))
        answer = {"role": "assistant", "content": f"Answer {question}."}
        turns += [turn, answer]
    return out


PATTERNS: dict[str, Callable[..., list[TraceRequest]]] = {
    "raw": raw,
    "agent_meta": agent_meta,
    "sysvar": sysvar,
    "compact": compact,
    "rerank": rerank,
    "tool_variants": tool_variants,
    "skewed": skewed,
}


def apply_pattern(name: str, requests: list[TraceRequest], seed: int = 0, **params) -> list[TraceRequest]:
    if name not in PATTERNS:
        raise UserFacingError(f"unknown pattern {name!r}: use one of {', '.join(PATTERNS)}")
    return PATTERNS[name](requests, seed=seed, **params)
