"""In-tree PD load balancer for one prefill and one decode server (aiohttp).

Used by ``launch_pd`` where ``sglang_router`` is not installed: no SGLang
release from 0.5.10.post1 to 0.5.23 ships a mini load balancer of its own.
It speaks the same protocol as ``sglang_router``'s PD mode: every generate
request gets ``bootstrap_host``/``bootstrap_port`` (the prefill server's host
and bootstrap port) and a random ``bootstrap_room``, goes to prefill and decode
at the same time, and the client receives decode's answer. With
``return_logprob`` the prefill side's input logprobs are put in front of
decode's. Same arguments as ``sglang_router.launch_router --pd-disaggregation``:

    python -m sglang_disagg_ext.deploy.mini_lb --prefill http://127.0.0.1:30000 8998 \\
        --decode http://127.0.0.1:30001 --host 127.0.0.1 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import urllib.parse
from typing import List, Optional, Tuple

from aiohttp import ClientSession, ClientTimeout, web

LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
STREAM_CHUNK = 64 * 1024


def bootstrap_host(prefill_url: str) -> str:
    host = urllib.parse.urlparse(prefill_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def new_room() -> int:
    return random.randint(0, 2**63 - 1)


def batch_size(request: dict) -> Optional[int]:
    """None for a single request, else how many prompts it carries."""
    text = request.get("text")
    if text is not None:
        return None if isinstance(text, str) else len(text)
    input_ids = request.get("input_ids")
    if input_ids:
        return None if isinstance(input_ids[0], int) else len(input_ids)
    return None


def add_bootstrap(request: dict, host: str, port: int, rooms: Optional[List[int]] = None) -> dict:
    """The request as sent to both servers: same room(s) on both sides."""
    out = dict(request)
    n = batch_size(request)
    if n is None:
        out.update(bootstrap_host=host, bootstrap_port=port,
                   bootstrap_room=rooms[0] if rooms else new_room())
    else:
        out.update(bootstrap_host=[host] * n, bootstrap_port=[port] * n,
                   bootstrap_room=list(rooms) if rooms else [new_room() for _ in range(n)])
    return out


def merge_input_logprobs(prefill: dict, decode: dict) -> dict:
    """Put prefill's input logprobs in front of decode's (decode only sees the last input token)."""
    p_meta, d_meta = prefill.get("meta_info", {}), decode.get("meta_info")
    if isinstance(d_meta, dict):
        for key in LOGPROB_KEYS:
            if key in p_meta and key in d_meta:
                d_meta[key] = p_meta[key] + d_meta[key]
    return decode


class MiniLB:
    def __init__(self, prefill_url: str, prefill_bootstrap: int, decode_url: str, timeout: float):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.bootstrap_port = prefill_bootstrap
        self.timeout = ClientTimeout(total=timeout)
        self.session: Optional[ClientSession] = None

    async def on_startup(self, app):
        self.session = ClientSession(timeout=self.timeout)

    async def on_cleanup(self, app):
        await self.session.close()

    async def health(self, request):
        return web.Response(status=200)

    async def _get_json(self, url: str):
        async with self.session.get(url) as resp:
            body = await resp.read()
            return resp.status, body

    async def from_prefill(self, request):
        status, body = await self._get_json(f"{self.prefill_url}{request.path}")
        return web.Response(status=status, body=body, content_type="application/json")

    async def to_both(self, request):
        """GET/POST on both servers (health_generate, flush_cache); 200 when both answer 200."""
        data = await request.read() if request.method == "POST" else None
        results = await asyncio.gather(
            *(self.session.request(request.method, f"{url}{request.path}", data=data)
              for url in (self.prefill_url, self.decode_url)),
            return_exceptions=True,
        )
        bad = []
        for url, res in zip((self.prefill_url, self.decode_url), results):
            if isinstance(res, BaseException):
                bad.append(f"{url}: {res!r}")
            else:
                if res.status != 200:
                    bad.append(f"{url}: HTTP {res.status}")
                res.release()
        if bad:
            return web.Response(status=503, text="; ".join(bad))
        return web.Response(status=200)

    async def server_info(self, request):
        infos = {}
        for side, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            status, body = await self._get_json(f"{url}{request.path}")
            infos[side] = [json.loads(body)] if status == 200 else []
        internal = [s for info in infos["decode"] for s in info.get("internal_states", [])]
        return web.json_response({"internal_states": internal, **infos})

    async def generate(self, request):
        payload = await request.json()
        endpoint = request.path
        modified = add_bootstrap(payload, bootstrap_host(self.prefill_url), self.bootstrap_port)
        if payload.get("stream"):
            return await self._stream(request, modified, endpoint)
        prefill_task = self.session.post(f"{self.prefill_url}{endpoint}", json=modified)
        decode_task = self.session.post(f"{self.decode_url}{endpoint}", json=modified)
        prefill_resp, decode_resp = await asyncio.gather(prefill_task, decode_task)
        try:
            decode_body = await decode_resp.read()
            prefill_body = await prefill_resp.read()
            if payload.get("return_logprob") and decode_resp.status == 200 and prefill_resp.status == 200:
                merged = merge_input_logprobs(json.loads(prefill_body), json.loads(decode_body))
                return web.json_response(merged, status=decode_resp.status)
            return web.Response(status=decode_resp.status, body=decode_body,
                                content_type=decode_resp.content_type)
        finally:
            prefill_resp.release()
            decode_resp.release()

    async def _stream(self, request, modified: dict, endpoint: str):
        prefill_resp, decode_resp = await asyncio.gather(
            self.session.post(f"{self.prefill_url}{endpoint}", json=modified),
            self.session.post(f"{self.decode_url}{endpoint}", json=modified),
        )
        out = web.StreamResponse(status=decode_resp.status, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            async for chunk in decode_resp.content.iter_chunked(STREAM_CHUNK):
                await out.write(chunk)
            await prefill_resp.read()
        finally:
            prefill_resp.release()
            decode_resp.release()
        await out.write_eof()
        return out


def build_app(lb: MiniLB) -> web.Application:
    app = web.Application(client_max_size=512 * 1024 * 1024)
    app.on_startup.append(lb.on_startup)
    app.on_cleanup.append(lb.on_cleanup)
    app.router.add_get("/health", lb.health)
    app.router.add_get("/health_generate", lb.to_both)
    app.router.add_post("/flush_cache", lb.to_both)
    app.router.add_get("/get_model_info", lb.from_prefill)
    app.router.add_get("/model_info", lb.from_prefill)
    app.router.add_get("/v1/models", lb.from_prefill)
    app.router.add_get("/get_server_info", lb.server_info)
    app.router.add_get("/server_info", lb.server_info)
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, lb.generate)
    return app


def parse_prefill(values: List[str]) -> Tuple[str, int]:
    if len(values) not in (1, 2):
        raise SystemExit("mini_lb: --prefill takes URL [BOOTSTRAP_PORT]")
    port = 8998 if len(values) == 1 else values[1]  # SGLang's default bootstrap port
    try:
        return values[0], int(port)
    except ValueError:
        raise SystemExit(f"mini_lb: bootstrap port {port!r} is not an integer") from None


def main(argv=None) -> int:
    from sglang_disagg_ext.help_text import plain_text  # --help shows the docstring without its RST markup

    parser = argparse.ArgumentParser(prog="mini_lb", description=plain_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL [BOOTSTRAP_PORT]")
    parser.add_argument("--decode", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    args = parser.parse_args(argv)
    prefill_url, bootstrap = parse_prefill(args.prefill)
    lb = MiniLB(prefill_url, bootstrap, args.decode, args.request_timeout)
    print(f"mini_lb: prefill {prefill_url} (bootstrap {bootstrap}), decode {args.decode}, "
          f"listening on {args.host}:{args.port}", flush=True)
    web.run_app(build_app(lb), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
