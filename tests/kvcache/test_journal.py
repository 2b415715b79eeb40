"""The chunk journal a fleet router follows: any interleaving of additions, removals and polls
leaves every follower with exactly the resident set, shipping only the changes."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from irminsul.kvcache.journal import ChunkJournal


class Follower:
    def __init__(self):
        self.seq, self.known = None, set()

    def poll(self, journal: ChunkJournal):
        delta = journal.since(self.seq)
        if delta.full:
            self.known = set()
        self.known |= {int(f) for f in delta.added}
        self.known -= {int(f) for f in delta.removed}
        self.seq = delta.seq
        return delta


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "remove", "poll0", "poll1"]), st.integers(0, 12)), max_size=120),
    keep=st.sampled_from([4, 16, 1 << 20]),
)
def test_followers_see_exactly_what_is_resident(ops, keep):
    journal, truth, followers = ChunkJournal(keep=keep), {}, [Follower(), Follower()]
    for op, fp in ops:
        fp = fp * 0x9E3779B97F4A7C15 % 2**64  # spread over the 64-bit range
        if op == "add":
            journal.added(fp)
            truth[fp] = truth.get(fp, 0) + 1
        elif op == "remove" and truth.get(fp):
            journal.removed(fp)
            truth[fp] -= 1
            if not truth[fp]:
                del truth[fp]
        elif op.startswith("poll"):
            delta = followers[int(op[-1])].poll(journal)
            assert not set(delta.added.tolist()) & set(delta.removed.tolist())
            assert followers[int(op[-1])].known == set(truth)
    for f in followers:
        f.poll(journal)
        assert f.known == set(truth) == {fp for fp in truth if fp in journal}


def test_a_follower_in_step_gets_the_churn_not_the_contents():
    journal, follower = ChunkJournal(), Follower()
    for fp in range(100_000):
        journal.added(fp)
    assert follower.poll(journal).nbytes == 800_000  # the first poll: everything, 8 bytes each
    for fp in range(100_000, 100_100):
        journal.added(fp)
        journal.removed(fp - 100_000)
    delta = follower.poll(journal)
    assert not delta.full and delta.nbytes == 1_600 and len(follower.known) == 100_000
    assert np.array_equal(np.sort(delta.added), np.arange(100_000, 100_100, dtype=np.uint64))
