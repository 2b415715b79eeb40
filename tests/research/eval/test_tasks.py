"""Shifted-reuse cases really shift the shared content and keep the question new."""

import numpy as np
import pytest

from irminsul.model.tiny import make_tiny_checkpoint
from irminsul.research.eval.tasks import AgentConversations, Sweep, TaskData, agent_meta_case, musique, niah


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return TaskData(make_tiny_checkpoint(tmp_path_factory.mktemp("tasks") / "m"))


def _at(seq, sub):
    return next(i for i in range(len(seq)) if seq[i : i + len(sub)] == sub)


def test_niah_moves_the_haystack_by_delta(data):
    case = niah(data, np.random.default_rng(0), 300, depth=40, delta=-25)
    shared = case.first[-case.shared :]
    assert _at(case.prompt, shared) - _at(case.first, shared) == -25 == case.delta
    assert _at(case.first, shared) == 2 + 40
    tail = case.prompt[_at(case.prompt, shared) + len(shared) :]
    assert data.tok.decode(tail).startswith("\n\nWhat is the passkey?")  # the question is new, not cached
    assert _at(shared, case.answer) >= 0  # the needle is inside the cached content


def test_musique_reorders_documents_and_moves_the_answer(data):
    case = musique(data, np.random.default_rng(1), 500)
    assert case.delta != 0 and case.prompt[: len(case.first)] != case.first
    assert sorted(case.first[2:]) == sorted(case.prompt[2 : len(case.first)])  # same documents, other order


def test_agent_meta_changes_only_the_header(data):
    conv = AgentConversations(data, max_body=400)
    assert conv.turns
    case = agent_meta_case(data, conv, np.random.default_rng(2))
    body = case.first[-case.shared :]
    assert case.prompt[-case.shared - 1 : -1] == body
    assert case.first[: -case.shared] != case.prompt[: -case.shared - 1]
    assert case.scoring == "tokens"


def test_sweep_cells_keep_positions_non_negative_and_scale():
    cells = Sweep().cells()
    assert all(a + d >= 0 for a, d in cells) and len(cells) == 11
    assert max(Sweep().scaled(512).depths) < max(Sweep().depths)


def test_segments_start_each_part_so_shared_parts_chunk_alike(data):
    for case in (
        niah(data, np.random.default_rng(3), 300, depth=40, delta=60),
        musique(data, np.random.default_rng(4), 500),
        agent_meta_case(data, AgentConversations(data, max_body=400), np.random.default_rng(5)),
    ):
        for ids, starts in ((case.first, case.first_segments), (case.prompt, case.prompt_segments)):
            assert starts[0] == 0 and list(starts) == sorted(set(starts)) and starts[-1] < len(ids)
        shared = case.first[-case.shared :] if case.task != "musique" else None
        if shared:  # the shared content begins a segment in both
            assert len(case.first) - case.shared in case.first_segments
            assert _at(case.prompt, shared) in case.prompt_segments
