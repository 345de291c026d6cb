"""verl's SearchTool (verl/tools/search_tool.py) over a local BM25 retrieval, and verl's retrieval HTTP API.

verl's search tool config (examples/sglang_multiturn/config/tool_config/search_tool_config.yaml) works as written;
``retrieval_service_url`` picks where the search runs::

    config:
      retrieval_service_url: local                # in this process: BM25 (bm25s) over corpus_path
      corpus_path: data/corpus.jsonl              # one {"id": ..., "contents": "\"Title\"\\nText"} a line (search-R1);
                                                  # relative: from the CWD, else the repository root
      topk: 3
      timeout: 30
      bm25_k1: 0.9                                # Lucene's BM25 parameters; defaults: pyserini's (verl's BM25
      bm25_b: 0.4                                 # retriever), k1=0.9, b=0.4
    # or  retrieval_service_url: http://127.0.0.1:8000/retrieve   (verl's retrieval server, or ours:
    #     rlhf retrieval serve --corpus data/corpus.jsonl --port 8000)

The model calls ``search`` with ``query_list``; the answer is verl's ``perform_single_search_batch`` text,
``{"result": "Doc 1 (Title: ...)\\n...\\n\\nDoc 2 ...\\n---\\n<next query>"}`` (JSON), or verl's error / "No search
results found." text.  BM25 is Lucene's variant (bm25s ``method="lucene"``): for query terms q in document d,
``score = sum_q idf(q) * tf / (tf + k1 * (1 - b + b * |d| / avgdl))`` with ``idf = ln(1 + (N - df + 0.5) /
(df + 0.5))``; terms are lower-cased words of 2+ characters without English stop words (bm25s' tokenizer, no
stemming); only documents with a positive score are hits, ties go to the earlier document.
"""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional

from rlhf.agent.config import resolve_config_file
from rlhf.agent.tools import BaseTool, ToolResponse

__all__ = ["BM25Index", "SearchTool", "bm25_index", "format_results", "LOCAL"]

#: retrieval_service_url of the in-process BM25 search
LOCAL = "local"
_INDEXES: dict = {}
_INDEX_LOCK = threading.Lock()


class BM25Index:
    """BM25 over a corpus file (jsonl of ``{"id", "contents", ...}``), with bm25s.

    Args:
        corpus_path: the file; every line a JSON object with a string ``contents``.
        k1, b: BM25's term-frequency saturation and length normalisation.

    Raises:
        ValueError: the file is missing, empty, or a line is not such an object (line number named).
        ImportError: bm25s is not installed (``pip install -e '.[agent]'``).
    """

    def __init__(self, corpus_path: str, k1: float = 0.9, b: float = 0.4):
        import bm25s

        path = Path(corpus_path).expanduser()
        if not path.is_file():
            raise ValueError(f"corpus_path={corpus_path!r} is not a file (relative paths are read from {Path.cwd()})")
        self.docs: list[dict] = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{corpus_path}:{n} is not JSON ({e})") from e
                if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                    raise ValueError(f"{corpus_path}:{n} needs a string 'contents' (search-R1's corpus layout: "
                                     f'{{"id": "0", "contents": "\\"Title\\"\\nText"}})')
                self.docs.append(row)
        if not self.docs:
            raise ValueError(f"corpus_path={corpus_path!r} holds no documents")
        self._bm25s = bm25s
        self.retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
        self.retriever.index(self._tokens([d["contents"] for d in self.docs]), show_progress=False)

    def _tokens(self, texts: list[str]):
        return self._bm25s.tokenize(texts, stopwords="en", show_progress=False)

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Per query, up to ``topk`` hits ``{"document": corpus row, "score": BM25 score}``, best first (verl's
        retrieval server's ``result`` with ``return_scores``)."""
        import numpy as np

        out = []
        for words in self._bm25s.tokenize(list(queries), stopwords="en", show_progress=False, return_ids=False):
            scores = np.asarray(self.retriever.get_scores(words), dtype=np.float64) if words else \
                np.zeros(len(self.docs))
            hits = np.flatnonzero(scores > 0)
            order = hits[np.lexsort((hits, -scores[hits]))][:max(int(topk), 0)]  # score desc, then corpus order
            out.append([{"document": self.docs[i], "score": float(scores[i])} for i in order])
        return out


def bm25_index(corpus_path: str, k1: float = 0.9, b: float = 0.4) -> BM25Index:
    """The process's :class:`BM25Index` of the file (built once per path, modification time and parameters)."""
    p = Path(corpus_path).expanduser()
    key = (str(p.resolve()), p.stat().st_mtime_ns if p.is_file() else None, float(k1), float(b))
    with _INDEX_LOCK:
        if key not in _INDEXES:
            _INDEXES[key] = BM25Index(corpus_path, k1, b)
        return _INDEXES[key]


def format_results(results: list) -> tuple[str, str]:
    """verl's ``perform_single_search_batch`` answer of a retrieval ``result`` list: (JSON text, status)."""
    if not results:
        return json.dumps({"result": "No search results found."}, ensure_ascii=False), "no_results"
    pretty = []
    for retrieval in results:
        ref = ""
        for idx, item in enumerate(retrieval):  # verl's _passages2string
            content = item["document"]["contents"]
            title, text = content.split("\n")[0], "\n".join(content.split("\n")[1:])
            ref += f"Doc {idx + 1} (Title: {title})\n{text}\n\n"
        pretty.append(ref.strip())
    return json.dumps({"result": "\n---\n".join(pretty)}, ensure_ascii=False), "success"


def _post(url: str, queries: list, topk: int, timeout: float) -> list:
    body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as r:
        return json.loads(r.read()).get("result", [])


class SearchTool(BaseTool):
    """verl's SearchTool (module docstring for the config keys).

    Raises (on construction):
        ValueError: a bad config value (as :meth:`config_problems` names it) or a bad corpus file.
    """

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        problems = self.config_problems(self.config)
        if problems:
            raise ValueError("; ".join(problems))
        c = self.config
        self.retrieval_service_url = c["retrieval_service_url"]
        self.topk, self.timeout = int(c.get("topk", 3)), float(c.get("timeout", 30))
        self._workers = threading.BoundedSemaphore(int(c.get("num_workers", 120)))
        self._instances: dict[str, dict] = {}
        self.index = bm25_index(str(resolve_config_file(str(c["corpus_path"]))), float(c.get("bm25_k1", 0.9)),
                                float(c.get("bm25_b", 0.4))) if self.retrieval_service_url == LOCAL else None

    @classmethod
    def config_problems(cls, config: dict) -> list[str]:
        """Bad values of the tool's ``config:`` (checked at ``--cfg``), each naming the key and the fix."""
        out = []
        url = config.get("retrieval_service_url")
        if url == LOCAL:
            corpus = config.get("corpus_path")
            if not corpus or not resolve_config_file(str(corpus)).is_file():
                out.append(f"SearchTool config retrieval_service_url=local needs corpus_path, a jsonl file of "
                           f"{{id, contents}} (got corpus_path={corpus!r}; relative paths are read from {Path.cwd()})")
            try:
                import bm25s  # noqa: F401
            except ImportError:
                out.append("SearchTool config retrieval_service_url=local needs bm25s: pip install -e '.[agent]'")
        elif not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            out.append(f"SearchTool config retrieval_service_url={url!r} must be the http(s) URL of a retrieval "
                       f"server's /retrieve (verl's API; e.g. rlhf retrieval serve) or 'local' with corpus_path")
        for key, default in (("topk", 3), ("num_workers", 120)):
            v = config.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                out.append(f"SearchTool config {key}={v!r} must be an integer >= 1")
        v = config.get("timeout", 30)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            out.append(f"SearchTool config timeout={v!r} must be a number of seconds > 0")
        return out

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "reward": []}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """verl's execute: (the answer text, 0.0, {query_count, status, total_results, api_request_error}); a
        missing or non-list ``query_list`` and a failed search are answered in the text, as verl does."""
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            msg = "Error: 'query_list' is missing, empty, or not a list in parameters."
            return ToolResponse(text=json.dumps({"result": msg})), 0.0, {}
        queries = [q if isinstance(q, str) else json.dumps(q) for q in queries]
        try:
            results = await asyncio.to_thread(self._search, queries)
            text, status = format_results(results)
            error = None
        except Exception as e:  # noqa: BLE001 - verl: the failure is the model's message
            text, status, error = json.dumps({"result": f"Search error: API Call Failed: {e}"}), "api_error", str(e)
            results = []
        if instance_id in self._instances:
            self._instances[instance_id]["reward"].append(text.strip())
        return ToolResponse(text=text), 0.0, {"query_count": len(queries), "status": status,
                                              "total_results": sum(len(r) for r in results),
                                              "api_request_error": error}

    def _search(self, queries: list[str]) -> list:
        with self._workers:
            if self.index is not None:
                return self.index.search(queries, self.topk)
            return _post(self.retrieval_service_url, queries, self.topk, self.timeout)

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


def make_app(index: BM25Index, default_topk: int = 3):
    """An aiohttp app serving verl's ``POST /retrieve`` (``{queries, topk, return_scores}`` -> ``{"result":
    [[{"document", "score"} | document, ...] per query]}``) over ``index``; 422 on a malformed body."""
    from aiohttp import web

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            queries, topk = body["queries"], body.get("topk") or default_topk
            if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries) or \
                    isinstance(topk, bool) or not isinstance(topk, int):
                raise TypeError("queries must be a list of strings and topk an integer")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return web.json_response({"detail": f"bad request: {e}"}, status=422)
        hits = await asyncio.to_thread(index.search, queries, topk)
        if not body.get("return_scores"):
            hits = [[h["document"] for h in per] for per in hits]
        return web.json_response({"result": hits})

    app = web.Application()
    app.add_routes([web.post("/retrieve", retrieve)])
    return app


def add_serve_args(p) -> None:
    p.add_argument("--corpus", required=True, help="jsonl corpus, one {id, contents} a line")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000, verl's example URL's)")
    p.add_argument("--topk", type=int, default=3, help="hits per query when a request gives no topk")
    p.add_argument("--k1", type=float, default=0.9)
    p.add_argument("--b", type=float, default=0.4)


def serve_from_args(args) -> int:
    """``rlhf retrieval serve``: verl's /retrieve over BM25 until interrupted; 2 on a bad corpus."""
    import sys

    from aiohttp import web

    try:
        index = BM25Index(args.corpus, args.k1, args.b)
    except (ValueError, ImportError) as e:
        print(f"rlhf retrieval serve: {e}", file=sys.stderr)
        return 2
    print(f"rlhf retrieval listening on http://{args.host}:{args.port}/retrieve ({len(index.docs)} documents)",
          flush=True)
    web.run_app(make_app(index, args.topk), host=args.host, port=args.port, print=None)
    return 0
