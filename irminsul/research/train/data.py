"""Real text from `irminsul/data/`, rendered as documents, with a held-out slice of every source.

Each source becomes a list of documents (strings). Chat-shaped records are rendered in the bundled
chat format (`irminsul/model/chat_format.py`), so the model sees its own serving format.
A document is held out when a stable hash of its text falls in the held-out bucket (1 in 10),
so the split does not depend on file order or on the seed.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from irminsul.data import data_dir as find_data_dir
from irminsul.model.chat_format import IRMINSUL, LEGACY_ROLES

SOURCES = ("tau_bench", "bfcl", "toolbench", "musique")
HELD_OUT_BUCKETS = 10  # 1 document in 10 is held out


def render_chat(messages: list[dict]) -> str:
    """A training document in the bundled chat format: `<|role|>content<|end|>` per message, what the
    chat template writes for plain messages. Apart from `segment_texts` because the records are raw
    data, not validated requests (content may be an object, written as JSON; arguments as they
    are), and because this text, held-out hash included, is what the bundled models were trained on."""
    out = []
    for m in messages:
        role = m.get("role", "user")
        role = "tool" if role in LEGACY_ROLES else role
        content = m.get("content") or ""
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            content += json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}, ensure_ascii=False)
        out.append(IRMINSUL.opener[role] + content + IRMINSUL.closer[role])
    return "".join(out)


def is_held_out(text: str) -> bool:
    return int(hashlib.md5(text.encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def _tau_bench(d: Path) -> list[str]:
    docs = [render_chat(t["traj"]) for t in json.loads((d / "gpt-4o-airline.json").read_text())]
    for name in ("airline_wiki.md", "retail_wiki.md"):
        docs.append((d / name).read_text())
    for name in ("airline_tools.json", "retail_tools.json"):
        docs += [json.dumps(t, ensure_ascii=False) for t in json.loads((d / name).read_text())]
    return docs


def _bfcl(d: Path) -> list[str]:
    docs = []
    for f in sorted(d.glob("BFCL_v4_*.json")):
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            turns = r["question"][0] if r.get("question") else []
            tools = json.dumps(r.get("function", []), ensure_ascii=False)
            docs.append(render_chat([{"role": "system", "content": tools}, *turns]))
    for f in sorted((d / "multi_turn_func_doc").glob("*.json")):
        docs += [line for line in f.read_text().splitlines() if line.strip()]
    return docs


def _toolbench(d: Path) -> list[str]:
    docs = []
    for f in sorted(d.glob("data_example_answer_*.json")):
        runs = json.loads(f.read_text())["answer_generation"].get("train_messages") or []
        if runs:
            docs.append(render_chat(runs[-1]))
    for f in sorted(d.glob("data_example_instruction_*.json")):
        for q in json.loads(f.read_text()):
            docs.append(json.dumps(q.get("api_list", []), ensure_ascii=False) + "\n" + q.get("query", ""))
    return docs


def _musique(d: Path) -> list[str]:
    seen, docs = set(), []
    for item in json.loads((d / "musique_s.json").read_text()):
        for c in item["ctxs"]:
            if c["text"] not in seen:
                seen.add(c["text"])
                docs.append(c["text"])
    return docs


def musique_items(data_dir: Path) -> list[dict]:
    """The 120 MuSiQue QA items `{ctxs, question, answers}`; hold-out uses the question hash."""
    return json.loads((data_dir / "musique" / "musique_s.json").read_text())


def tool_schemas(data_dir: Path) -> list[dict]:
    """Distinct function schemas `{name, description, parameters}` from tau-bench and BFCL."""
    out: dict[str, dict] = {}
    for name in ("airline_tools.json", "retail_tools.json"):
        for t in json.loads((data_dir / "tau_bench" / name).read_text()):
            out.setdefault(t["function"]["name"], t["function"])
    for f in sorted((data_dir / "bfcl").glob("BFCL_v4_*.json")):
        for line in f.read_text().splitlines():
            if line.strip():
                for fn in json.loads(line).get("function", []):
                    out.setdefault(fn["name"], fn)
    return [out[k] for k in sorted(out)]


def key_words(texts: list[str], n: int = 2000) -> list[str]:
    """Frequent plain words (4-10 letters) used as keys in the key-value task."""
    counts: dict[str, int] = {}
    for t in texts:
        for w in t.split():
            if w.isalpha() and w.islower() and 4 <= len(w) <= 10:
                counts[w] = counts.get(w, 0) + 1
    return sorted(sorted(counts, key=lambda w: (-counts[w], w))[:n])


@dataclass(frozen=True)
class Corpus:
    train: dict[str, list[str]]
    held_out: dict[str, list[str]]
    tools_train: list[dict]
    tools_held_out: list[dict]
    words: list[str]

    @classmethod
    def load(cls, data_dir: Path | None = None) -> "Corpus":
        data_dir = find_data_dir(data_dir)
        loaders = {"tau_bench": _tau_bench, "bfcl": _bfcl, "toolbench": _toolbench, "musique": _musique}
        train, held = {}, {}
        for name in SOURCES:
            docs = [t for t in loaders[name](data_dir / name) if t.strip()]
            train[name] = [t for t in docs if not is_held_out(t)]
            held[name] = [t for t in docs if is_held_out(t)]
        tools = tool_schemas(data_dir)
        tools_train = [t for t in tools if not is_held_out(t["name"])]
        tools_held = [t for t in tools if is_held_out(t["name"])]
        return cls(train, held, tools_train, tools_held, key_words(train["musique"]))

    def all_train_text(self):
        for docs in self.train.values():
            yield from docs
