"""Trace builders: the real data in `irminsul/data/` (see its ATTRIBUTION.md) turned into requests.

- `tau_bench`: every assistant turn of every GPT-4o airline trajectory is one request; the policy
  is the system prompt and the tools are `airline_tools.json`.
- `bfcl`: multi-turn records (one request per user turn, with their classes' schemas) and
  live-multiple records (grouped into sessions by function list).
- `toolbench`: the successive `train_messages` of each DFS answer (the target assistant message
  of each is dropped: it is the output, not the prompt).
- `musique`: one RAG request per question, its 10 passages as separate text parts.
Sessions are emitted one after another, each in its own order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from irminsul.data import data_dir
from irminsul.errors import UserFacingError
from irminsul.research.workloads.trace import TraceRequest

# bfcl_eval's MULTI_TURN_FUNC_DOC_FILE_MAPPING: class name -> schema file
BFCL_CLASS_FILES = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
    "WebSearchAPI": "web_search",
    "MemoryAPI_kv": "memory_kv",
    "MemoryAPI_vector": "memory_vector",
    "MemoryAPI_rec_sum": "memory_rec_sum",
}

# CacheBlend's MuSiQue prompt (YaoJiayi/CacheBlend, example/blend_musique.py).
MUSIQUE_SYSTEM = (
    "You will be asked a question after reading several passages. Please directly answer the "
    "question based on the given passages. Do NOT repeat the question. The answer should be "
    "within 5 words.."
)
MUSIQUE_QUERY = (
    "Answer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words. \nQuestion: "
)


def _missing(path: Path) -> UserFacingError:
    return UserFacingError(f"missing data file {path} (is --data the right folder?)")


def _load_json(path: Path):
    if not path.exists():
        raise _missing(path)
    return json.loads(path.read_text(encoding="utf-8"))


def _load_jsonl(path: Path) -> list:
    if not path.exists():
        raise _missing(path)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _tool(schema: dict) -> dict:
    return schema if schema.get("type") == "function" else {"type": "function", "function": schema}


def tau_bench(data: Path) -> list[TraceRequest]:
    trajectories = _load_json(data / "tau_bench" / "gpt-4o-airline.json")
    tools = tuple(_load_json(data / "tau_bench" / "airline_tools.json"))
    out = []
    for t in trajectories:
        session = f"tau-{t['task_id']}-{t['trial']}"
        traj = t["traj"]
        out += [TraceRequest(session, tuple(traj[:i]), tools) for i, m in enumerate(traj) if m["role"] == "assistant"]
    return out


def bfcl(data: Path) -> list[TraceRequest]:
    root = data / "bfcl"
    out = []
    for rec in _load_jsonl(root / "BFCL_v4_multi_turn_base.json"):
        excluded = set(rec.get("excluded_function", []))
        tools = tuple(
            _tool(f)
            for c in rec["involved_classes"]
            for f in _load_jsonl(root / "multi_turn_func_doc" / f"{BFCL_CLASS_FILES[c]}.json")
            if f["name"] not in excluded
        )
        history: list = []
        for turn in rec["question"]:
            history += turn
            if turn:
                out.append(TraceRequest(rec["id"], tuple(history), tools))
    for rec in _load_jsonl(root / "BFCL_v4_live_multiple.json"):
        group = re.match(r"live_multiple_\d+-(\d+)-\d+", rec["id"])
        session = f"live_multiple-{group.group(1) if group else rec['id']}"
        out.append(TraceRequest(session, tuple(rec["question"][0]), tuple(_tool(f) for f in rec["function"])))
    return out


def toolbench(data: Path) -> list[TraceRequest]:
    out = []
    paths = sorted((data / "toolbench").glob("data_example_answer_*.json"))
    if not paths:
        raise _missing(data / "toolbench" / "data_example_answer_*.json")
    for path in paths:
        answer = _load_json(path)["answer_generation"]
        tools = tuple(_tool(f) for f in answer.get("function", []))
        for messages in answer.get("train_messages", []):
            prompt = messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages
            out.append(TraceRequest(path.stem.removeprefix("data_example_answer_"), tuple(prompt), tools))
    return out


def musique(data: Path) -> list[TraceRequest]:
    out = []
    for i, item in enumerate(_load_json(data / "musique" / "musique_s.json")):
        parts = [{"type": "text", "text": (c["title"] + "\n" if c["title"] else "") + c["text"]} for c in item["ctxs"]]
        parts.append({"type": "text", "text": MUSIQUE_QUERY + item["question"]})
        out.append(
            TraceRequest(
                f"musique-{i}", ({"role": "system", "content": MUSIQUE_SYSTEM}, {"role": "user", "content": parts})
            )
        )
    return out


SOURCES: dict[str, Callable[[Path], list[TraceRequest]]] = {
    "tau_bench": tau_bench,
    "bfcl": bfcl,
    "toolbench": toolbench,
    "musique": musique,
}


def first_sessions(requests: list[TraceRequest], n: int | None) -> list[TraceRequest]:
    """The requests of the first `n` sessions (in order of first appearance)."""
    if n is None:
        return requests
    keep: dict[str, None] = {}
    for r in requests:
        if r.session not in keep and len(keep) < n:
            keep[r.session] = None
    return [r for r in requests if r.session in keep]


def build_source(name: str, data: Path | None = None, n: int | None = None) -> list[TraceRequest]:
    if name not in SOURCES:
        raise UserFacingError(f"unknown source {name!r}: use one of {', '.join(SOURCES)}")
    return first_sessions(SOURCES[name](data_dir(data)), n)
