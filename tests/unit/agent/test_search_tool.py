"""verl's SearchTool (rlhf/agent/search.py): verl's search tool config maps to a BM25 retrieval over a local corpus
(in process, or behind verl's /retrieve HTTP API); scores and rankings are computed by hand below."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading

import pytest
import yaml

from rlhf.agent.config import MultiTurnSettings, config_problems, load_tool_specs
from rlhf.agent.loop import AgentLoop
from rlhf.agent.search import BM25Index, SearchTool, make_app
from rlhf.agent.tools import build_tools
from rlhf.rollout.sampling import SamplingConfig
from tests.support.agent_fakes import ScriptedFleet, tool_call

pytest.importorskip("bm25s")

#: verl's examples/sglang_multiturn/config/tool_config/search_tool_config.yaml, verbatim
VERL_TOOL_CONFIG = """\
tools:
  - class_name: verl.tools.search_tool.SearchTool
    config:
      retrieval_service_url: http://127.0.0.1:8000/retrieve
      num_workers: 120
      rate_limit: 120
      timeout: 30
      type: native
    tool_schema:
      type: function
      function:
        name: search
        description: Searches the web for relevant information based on the given query.
        parameters:
          type: object
          properties:
            query_list:
              type: array
              item:
                type: string
              description: A list of fully-formed semantic queries. The tool will return search results for each query.
          required: 
            - query_list
"""
# no stop words, each word 2+ characters: the terms are the lower-cased words
CORPUS = ['"Paris"\nParis capital France', '"Lyon"\nLyon city France Rhone river', '"Berlin"\nBerlin capital Germany',
          '"Rhone"\nRhone river Lyon']
K1, B, N, AVGDL = 0.9, 0.4, 4, (4 + 6 + 4 + 4) / 4


def bm25(tf: int, df: int, dl: int) -> float:
    """Lucene's BM25 term score, by hand."""
    return math.log(1 + (N - df + 0.5) / (df + 0.5)) * tf / (tf + K1 * (1 - B + B * dl / AVGDL))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": c}) + "\n" for i, c in enumerate(CORPUS)))
    return str(path)


def verl_config(tmp_path, **config) -> str:
    cfg = yaml.safe_load(VERL_TOOL_CONFIG)
    cfg["tools"][0]["config"].update(config)
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_bm25_scores_and_ranking_by_hand(corpus):
    [capital, rhone, tokyo] = BM25Index(corpus).search(["capital France", "the Rhone river?", "Tokyo"], topk=3)
    # capital: docs 0, 2 (df 2); france: docs 0, 1 (df 2); doc 1 has 6 terms, the others 4
    want = {0: bm25(1, 2, 4) * 2, 2: bm25(1, 2, 4), 1: bm25(1, 2, 6)}
    assert [h["document"]["id"] for h in capital] == ["0", "2", "1"]
    assert [h["score"] for h in capital] == pytest.approx([want[0], want[2], want[1]], rel=1e-5)
    # "the" is a stop word; rhone: docs 1, 3 (twice in 3), river: docs 1, 3
    assert [h["document"]["id"] for h in rhone] == ["3", "1"]
    assert [h["score"] for h in rhone] == pytest.approx([bm25(2, 2, 4) + bm25(1, 2, 4), 2 * bm25(1, 2, 6)], rel=1e-5)
    assert tokyo == []


def test_verl_config_in_the_agent_loop(tmp_path, corpus, tok):
    path = verl_config(tmp_path, retrieval_service_url="local", corpus_path=corpus, topk=2)
    assert config_problems(MultiTurnSettings(enable=True, tool_config_path=path)) == []
    tools = build_tools(load_tool_specs(path))
    assert isinstance(tools["search"], SearchTool)
    call = tool_call("search", json.dumps({"query_list": ["capital France", "Rhone"]}))
    fleet = ScriptedFleet(tok, lambda turn, p: call if turn == 0 else "done")
    agent = AgentLoop(MultiTurnSettings(enable=True, max_tool_response_length=2000), tok, 2000, tools=tools)
    [s], m = agent.run(fleet.generate, [{"raw_prompt": "Where?", "extra_info": {}}], SamplingConfig(max_new_tokens=1))
    a, b = s.extra["model_spans"][0][1], s.extra["model_spans"][1][0]
    text = tok.decode(s.response_ids[a:b])
    head, tail = "<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert text.startswith(head) and text.endswith(tail)
    # verl's perform_single_search_batch text: per query "Doc k (Title: <first line>)\n<rest>", queries by "---"
    assert json.loads(text[len(head):-len(tail)]) == {"result": (
        'Doc 1 (Title: "Paris")\nParis capital France\n\nDoc 2 (Title: "Berlin")\nBerlin capital Germany\n---\n'
        'Doc 1 (Title: "Rhone")\nRhone river Lyon\n\nDoc 2 (Title: "Lyon")\nLyon city France Rhone river')}
    assert m["tool_calls/success_rate"] == 1.0


def test_bad_queries_are_verls_messages(corpus):
    tool = SearchTool({"retrieval_service_url": "local", "corpus_path": corpus}, {"function": {"name": "search"}})
    for params in ({}, {"query_list": "Paris"}, {"query_list": []}):
        resp, reward, _ = asyncio.run(tool.execute("x", params))
        assert json.loads(resp.text) == {"result": "Error: 'query_list' is missing, empty, or not a list in "
                                                   "parameters."} and reward == 0.0
    # an unreachable retrieval server is the model's message, not an error
    tool = SearchTool({"retrieval_service_url": "http://127.0.0.1:9/retrieve", "timeout": 2},
                      {"function": {"name": "search"}})
    resp, _, metrics = asyncio.run(tool.execute("x", {"query_list": ["Paris"]}))
    assert json.loads(resp.text)["result"].startswith("Search error: API Call Failed") and \
        metrics["status"] == "api_error"


def test_verls_retrieval_api_over_http(tmp_path, corpus):
    """verl's config as written but the port: SearchTool posts to our /retrieve server over the same corpus."""
    from aiohttp import web

    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    loop, started = asyncio.new_event_loop(), threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(make_app(BM25Index(corpus)))
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    assert started.wait(30)
    try:
        [tool] = build_tools(load_tool_specs(verl_config(
            tmp_path, retrieval_service_url=f"http://127.0.0.1:{port}/retrieve"))).values()
        resp, _, metrics = asyncio.run(tool.execute("x", {"query_list": ["Rhone river"]}))
        assert json.loads(resp.text)["result"] == ('Doc 1 (Title: "Rhone")\nRhone river Lyon\n\n'
                                                   'Doc 2 (Title: "Lyon")\nLyon city France Rhone river')
        assert metrics == {"query_count": 1, "status": "success", "total_results": 2, "api_request_error": None}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)


@pytest.mark.parametrize("config, message", [
    ({"retrieval_service_url": "local"}, "retrieval_service_url=local needs corpus_path"),
    ({"retrieval_service_url": "retriever:8000"}, "retrieval_service_url='retriever:8000' must be the http(s) URL"),
    ({"topk": 0}, "topk=0 must be an integer >= 1"),
])
def test_bad_config_is_refused_at_cfg(tmp_path, config, message):
    [problem] = config_problems(MultiTurnSettings(enable=True, tool_config_path=verl_config(tmp_path, **config)))
    assert message in problem and "tool_config_path" in problem


def test_bad_corpus_line_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "0", "contents": "ok"}\n{"id": "1", "text": "no contents"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2 needs a string 'contents'"):
        BM25Index(str(path))


def test_retrieval_serve_refuses_a_bad_corpus(tmp_path, capsys):
    from rlhf.cli import main

    assert main(["retrieval", "serve", "--corpus", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl' is not a file" in capsys.readouterr().err
