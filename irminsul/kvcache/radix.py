"""Token-level radix tree of finished sequences: the exact-prefix cache (docs/design.md section 3 step 1).

In the spirit of SGLang's RadixAttention (Zheng et al., arXiv 2312.07104;
``python/sglang/srt/mem_cache/radix_cache.py``): each edge holds a run of token ids and the
value for exactly those tokens; a match walks edges from the root; LRU leaves that no running
request has locked are evicted first.

Values are opaque. When an edge is split at ``k`` the tree calls ``split_value(value, k) ->
(left, right)``. The default slices axis 0 (lists, numpy arrays; ``None`` stays ``None`` for
model-free replay); the engine stores the pool slots of the edge's tokens. ``on_store(value)`` and
``on_evict(value)`` are told of every value the tree starts and stops holding (a split holds the
same tokens in two values, so it is neither), which is how the engine counts slot references.

Budget: ``bytes = stored tokens * bytes_per_token <= budget_bytes`` always holds. ``insert`` first
evicts unlocked LRU leaves (never the path it extends); if the new suffix still does not fit it
stores the longest prefix of that suffix that does (a prefix of a cached sequence is itself a
valid cached sequence), possibly nothing. (Model-free replays use that budget; the engine gives
the tree none of its own: its KV manager decides which rows go and the tree ``cut``s them.)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from irminsul.kvcache.chunker import TokenArray, as_tokens

SplitFn = Callable[[Any, int], tuple[Any, Any]]


def split_axis0(value: Any, k: int) -> tuple[Any, Any]:
    """Default split: slice axis 0; ``None`` (model-free replay) splits into ``None``s."""
    return (None, None) if value is None else (value[:k], value[k:])


class Node:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: np.ndarray, value: Any, parent: Node | None, last_access: int):
        self.key = key  # [len] int64: the tokens on the edge from parent to this node
        self.value = value  # covers exactly ``key``
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        self.lock_ref = 0  # running requests whose match ends at or below this node
        self.last_access = last_access

    def __lt__(self, other: Node) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access

    @property
    def up(self) -> Node:
        """The parent of a node below the root (every node but the root has one)."""
        assert self.parent is not None, "the root has no parent"
        return self.parent


class PrefixPiece(NamedTuple):
    value: Any
    length: int


@dataclass(frozen=True)
class PrefixMatch:
    length: int  # tokens matched from the start
    node: Node  # the node where the match ends (lock it while the rows are in use)
    values: list[PrefixPiece]  # root to node, in order; their rows concatenate to [0, length)


class PrefixTree(Protocol):
    """What a planner needs of an exact-prefix tree: a `RadixCache`, or a tenant's salted view of one."""

    def match(self, tokens: TokenArray) -> PrefixMatch: ...
    def insert(self, tokens: TokenArray, value: Any) -> int: ...
    def lock(self, node: Node) -> None: ...
    def unlock(self, node: Node) -> None: ...


@dataclass(frozen=True)
class RadixStats:
    matches: int
    hits: int  # matches of length > 0
    tokens_matched: int
    tokens_inserted: int
    tokens_rejected: int  # tokens insert could not store within the budget
    evictions: int  # nodes
    tokens_evicted: int
    nodes: int  # excluding the root
    bytes: int
    budget_bytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RadixCache:
    def __init__(
        self,
        budget_bytes: int,
        bytes_per_token: int,
        split_value: SplitFn = split_axis0,
        on_store: Callable[[Any], None] | None = None,
        on_evict: Callable[[Any], None] | None = None,
    ):
        if budget_bytes < 0 or bytes_per_token < 1:
            raise ValueError("need budget_bytes >= 0 and bytes_per_token >= 1")
        self.budget_bytes, self.bytes_per_token = budget_bytes, bytes_per_token
        self.split_value = split_value
        self.on_store, self.on_evict = on_store, on_evict
        self._clock = itertools.count(1)  # logical time: deterministic LRU order
        self.root = Node(np.zeros(0, np.int64), None, None, 0)
        self.root.lock_ref = 1  # never evicted
        self._tokens = self._nodes = 0
        self._matches = self._hits = self._matched = 0
        self._inserted = self._rejected = self._evictions = self._evicted = 0

    @property
    def bytes(self) -> int:
        return self._tokens * self.bytes_per_token

    def match(self, tokens: TokenArray) -> PrefixMatch:
        """Longest cached prefix of ``tokens``; splits an edge so the match ends on a node."""
        node, length = self._walk(as_tokens(tokens))
        pieces, n = [], node
        while n is not self.root:
            pieces.append(PrefixPiece(n.value, len(n.key)))
            n = n.up
        self._matches += 1
        self._hits += length > 0
        self._matched += length
        return PrefixMatch(length, node, pieces[::-1])

    def insert(self, tokens: TokenArray, value: Any) -> int:
        """Cache ``tokens`` whose rows are ``value`` (covering all of them); returns tokens stored."""
        ids = as_tokens(tokens)
        node, length = self._walk(ids)
        if length == len(ids):
            return 0
        self.lock(node)  # NOTE: the path being extended must survive the eviction below
        try:
            need = (len(ids) - length) * self.bytes_per_token
            self.evict(self.bytes + need - self.budget_bytes)
        finally:
            self.unlock(node)
        fits = min(len(ids) - length, (self.budget_bytes - self.bytes) // self.bytes_per_token)
        self._rejected += len(ids) - length - fits
        if fits <= 0:
            return 0
        suffix = self.split_value(value, length)[1] if length else value
        if fits < len(ids) - length:
            suffix = self.split_value(suffix, fits)[0]
        child = Node(ids[length : length + fits].copy(), suffix, node, next(self._clock))
        node.children[int(ids[length])] = child
        if self.on_store is not None:
            self.on_store(suffix)
        self._tokens += fits
        self._nodes += 1
        self._inserted += fits
        return fits

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while node is not self.root:
            node.lock_ref += 1
            node = node.up

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                raise ValueError("unlock without a matching lock")
            node.lock_ref -= 1
            node = node.up

    def evict(self, nbytes: int, spare: Callable[[int], bool] | None = None) -> int:
        """Evict least recently used unlocked leaves until ``nbytes`` are freed; returns bytes freed.
        ``spare(first token)``: keep every key that starts with a token it says True for."""
        if nbytes <= 0:  # (every insert asks; the engine's tree has no budget of its own)
            return 0
        freed = 0
        leaves = [n for n in self._iter_nodes(spare) if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        while freed < nbytes and leaves:
            leaf = heapq.heappop(leaves)
            parent = leaf.up
            del parent.children[int(leaf.key[0])]
            freed += len(leaf.key) * self.bytes_per_token
            self._tokens -= len(leaf.key)
            self._nodes -= 1
            self._evictions += 1
            self._evicted += len(leaf.key)
            if self.on_evict is not None:
                self.on_evict(leaf.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def cut(self, first_dropped: Callable[[Any], int | None], hollow: Callable[[Any], bool] | None = None) -> int:
        """Forget rows named from outside: `first_dropped(value)` is the index of the first token of a
        node to drop (None: keep it all); that token, the rest of its node and every node below go,
        so what stays is still a set of cached prefixes. Locked nodes are cut too: the caller knows
        which rows it may take. `hollow(value)`: True for a value that names no rows (the engine's
        tenant salt token); a node the cut leaves childless and hollow goes too, and so on upwards,
        so that a key's leading token does not outlive every row below it. Returns tokens dropped."""
        dropped, stack, bare = 0, list(self.root.children.values()), []
        while stack:
            node = stack.pop()
            i = first_dropped(node.value)
            if i is None:
                stack.extend(node.children.values())
                continue
            dropped += self._drop_below(node)
            if i <= 0:
                del node.up.children[int(node.key[0])]
                dropped += self._forget(node.value, len(node.key), whole=True)
                bare.append(node.up)
            else:
                node.value, tail = self.split_value(node.value, i)
                dropped += self._forget(tail, len(node.key) - i, whole=False)
                node.key = node.key[:i]
                bare.append(node)
        if hollow is None:
            return dropped
        for node in bare:
            # (a node may be listed twice, or already gone: only one still in the tree is removed)
            while (
                node is not self.root
                and not node.children
                and hollow(node.value)
                and node.up.children.get(int(node.key[0])) is node
            ):
                del node.up.children[int(node.key[0])]
                dropped += self._forget(node.value, len(node.key), whole=True)
                node = node.up
        return dropped

    def _drop_below(self, node: Node) -> int:
        """Remove every descendant of node; tokens dropped."""
        dropped, stack = 0, list(node.children.values())
        node.children = {}
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            dropped += self._forget(child.value, len(child.key), whole=True)
        return dropped

    def _forget(self, value: Any, k: int, whole: bool) -> int:
        """Account for k tokens (value) leaving the tree; `whole`: a node went with them."""
        self._tokens -= k
        self._evicted += k
        self._nodes -= whole
        self._evictions += whole
        if self.on_evict is not None:
            self.on_evict(value)
        return k

    def locked_values(self) -> list:
        """The values of every locked node (rows a plan in progress is about to use)."""
        return [n.value for n in self._iter_nodes() if n.lock_ref and n.value is not None]

    @property
    def stats(self) -> RadixStats:
        return RadixStats(
            self._matches,
            self._hits,
            self._matched,
            self._inserted,
            self._rejected,
            self._evictions,
            self._evicted,
            self._nodes,
            self.bytes,
            self.budget_bytes,
        )

    def _walk(self, ids: np.ndarray) -> tuple[Node, int]:
        """Deepest node whose path is a prefix of ``ids`` (splitting a partly matched edge)."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            k = common_prefix(child.key, ids[pos:])
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            node, pos = child, pos + k  # a split child ends here: no grandchild matches ids[pos]
        return node, pos

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node."""
        left, right = self.split_value(node.value, k)
        upper = Node(node.key[:k], left, node.up, node.last_access)
        upper.lock_ref = node.lock_ref
        upper.children[int(node.key[k])] = node
        node.up.children[int(node.key[0])] = upper
        node.key, node.value, node.parent = node.key[k:], right, upper
        self._nodes += 1
        return upper

    def values(self) -> list:
        """Every stored value (the engine's slot arrays), for accounting."""
        return [n.value for n in self._iter_nodes() if n.value is not None]

    def firsts(self) -> list[int]:
        """The distinct first tokens of the stored keys."""
        return list(self.root.children)

    def values_under(self, first: int) -> list:
        """The values of every key that starts with the token ``first``."""
        top = self.root.children.get(int(first))
        if top is None:
            return []
        out, stack = [], [top]
        while stack:
            node = stack.pop()
            out.append(node.value)
            stack.extend(node.children.values())
        return out

    def _iter_nodes(self, spare: Callable[[int], bool] | None = None):
        stack = [n for t, n in self.root.children.items() if spare is None or not spare(t)]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
