"""Two vLLM-CPU replicas with Irminsul's connector on real Ray Serve, behind the fleet's ingress: the content
router sends a document moved behind a new header to the replica whose registry holds it, which loads its
rows; Ray's prefix router sends it by the prompt's prefix, which the new header changed.

One application serves the test: first under the content router, then redeployed under the prefix router
(Serve starts new replicas for it, with empty registries). About 3 minutes on 2 cores, mostly the two
starts of two vLLM engines.
"""

import concurrent.futures
import re
import time

import httpx
import numpy as np
import pytest

from tests.integrations import require_vllm

require_vllm()

from tests.integrations.test_vllm import _checkpoint  # noqa: E402
from tests.support.services import free_port, wait_for  # noqa: E402

WORDS = "alpha beta gamma delta vault code river stone ledger amber north quiet seven harbor".split()


def text(rng, words: int) -> str:
    return " ".join(rng.choice(WORDS, words)) + "\n"


def ask(url: str, model: str, prompt: str, max_tokens: int = 1) -> tuple[str, int, str]:
    """The replica that answered, the prompt tokens it did not compute, the router's explanation."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r.headers["x-irminsul-replica"], cached, r.headers.get("x-irminsul-route", "")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    import ray
    from ray import serve

    from irminsul.fleet.serve import FleetConfig, build_vllm
    from irminsul.server.config import ServerConfig

    model = str(_checkpoint(tmp_path_factory.mktemp("ck") / "v3", 2))
    ray.init(num_cpus=3, include_dashboard=False, logging_level="warning")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    vllm_args = [model, "--max-model-len", "4096", "--enforce-eager", "--max-num-seqs", "4"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}

    def deploy(router: str) -> None:
        # assignment_ttl_s=0: the router knows where a document is only from the replicas' journals
        fleet = FleetConfig(replicas=2, stats_period_s=0.5, router=router, assignment_ttl_s=0)
        serve.run(build_vllm(vllm_args, ServerConfig(model=model), fleet, env), name="vllm", route_prefix="/")

    deploy("content")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/health", timeout=30).json()["status"] == "ok", 300, "two vLLM replicas")
    yield url, model, deploy
    serve.shutdown()
    ray.shutdown()


def test_a_moved_document_goes_where_its_rows_are_and_is_loaded_there(fleet):
    from vllm.tokenizers import get_tokenizer

    url, model, deploy = fleet
    tokenizer = get_tokenizer(model)
    rng = np.random.default_rng(0)
    question = "Which code opens the vault?"
    # one document a replica: the second is sent while the first decodes, which its replica's load
    # reports as a running sequence. A fast CPU decodes the first before the second is sent; then the
    # router's explanation shows no running sequence, and it is tried again with new documents and a
    # longer first answer.
    for busy_tokens in (300, 1200, 3000):
        docs = [text(rng, 150) for _ in range(3)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(ask, url, model, text(rng, 12) + docs[0] + question, busy_tokens)
            time.sleep(2)  # (a few routing-stats periods)
            first = [ask(url, model, text(rng, 12) + docs[1] + question), busy.result()]
        if re.search(r"running [1-9]", first[0][2]):
            break
    holders = [first[1][0], first[0][0]]
    assert len(set(holders)) == 2, first
    time.sleep(2)  # (a few routing-stats periods: the journals reach the router)
    for doc, holder in zip(docs[:2], holders):
        n_doc = len(tokenizer.encode(doc, add_special_tokens=False))
        replica, cached, route = ask(url, model, text(rng, 30) + doc + question)  # a new, longer header
        assert replica == holder, route
        assert cached >= 0.7 * n_doc, (cached, n_doc, route)
        assert f"{holder}: cost" in route.split(" < ")[0] and "reuse 0/" not in route.split(" < ")[0], route

    # Ray's prefix router: a document moved behind a new header shares no prefix with what it routed, so
    # it goes to the replica whose tree of routed text is smaller, the one that has not seen the document,
    # and nothing is loaded there
    deploy("prefix")
    deadline = time.monotonic() + 120
    while (
        "x-irminsul-route"
        in httpx.post(
            url + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 1}, timeout=60
        ).headers
    ):  # (until the ingress's handle routes with the new router)
        assert time.monotonic() < deadline, "the prefix router never took over"
        time.sleep(1)
    seen, _, _ = ask(url, model, text(rng, 12) + docs[2] + question)
    moved, cached, _ = ask(url, model, text(rng, 30) + docs[2] + question)
    assert moved != seen and cached == 0
