"""Stand-in for an SGLang HTTP server, for deployment tests on a machine without a GPU.

A real ``sglang.launch_server`` cannot stay up on a CPU-only machine (it exits
with "No accelerator ... is available"), so tests that need servers which come
up, answer and are stopped run this instead, as ``python -m sglang_standin_server``
with this folder on PYTHONPATH. It takes ``sglang.launch_server``'s command line
(only ``--host``, ``--port``, ``--model-path``, ``--disaggregation-mode`` matter)
and answers the endpoints the router and SGLang's GSM8K client use:

- ``GET /health``, ``/get_model_info``, ``/get_server_info``, ``/server_info``
- ``POST /generate`` (single or batch ``text``): a decode (or colocated) stand-in
  answers from ``STANDIN_ANSWERS`` (a JSON file ``{question: reply}``, matched on
  the last ``Question: ...`` in the prompt, default reply ``"no idea"``); a prefill
  stand-in answers ``"from-prefill"``. ``meta_info`` carries ``completion_tokens``
  (words in the reply), the request's ``bootstrap_room`` and, with
  ``return_logprob``, one ``input_token_logprobs`` entry naming the mode.
- ``GET /_standin/requests``: every generate request received, as JSON.

``STANDIN_NEVER_HEALTHY=1`` makes ``/health`` answer 503 forever.
"""

import argparse
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.S)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", default="stand-in")
    parser.add_argument("--disaggregation-mode", default="null")
    args, _ = parser.parse_known_args()

    answers = {}
    if os.environ.get("STANDIN_ANSWERS"):
        with open(os.environ["STANDIN_ANSWERS"]) as fh:
            answers = json.load(fh)
    never_healthy = os.environ.get("STANDIN_NEVER_HEALTHY") == "1"
    received = []
    lock = threading.Lock()

    def reply_for(text, sampling, room, want_logprob):
        if args.disaggregation_mode == "prefill":
            out = "from-prefill"
        elif sampling.get("max_new_tokens") == 0:
            out = ""
        else:
            questions = QUESTION.findall(text or "")
            out = answers.get(questions[-1].strip(), "no idea") if questions else "no idea"
        meta = {"completion_tokens": len(out.split()), "bootstrap_room": room,
                "mode": args.disaggregation_mode}
        if want_logprob:
            meta["input_token_logprobs"] = [[-1.0, 0, args.disaggregation_mode]]
        return {"text": out, "meta_info": meta}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status, obj=None):
            body = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *a):
            pass

        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                self._send(503 if never_healthy else 200)
            elif self.path in ("/get_model_info", "/model_info"):
                self._send(200, {"model_path": args.model_path, "is_generation": True})
            elif self.path in ("/get_server_info", "/server_info"):
                self._send(200, {"internal_states": [], "mode": args.disaggregation_mode})
            elif self.path == "/_standin/requests":
                with lock:
                    self._send(200, list(received))
            else:
                self._send(404, {"error": self.path})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            payload = json.loads(self.rfile.read(length) or b"{}")
            if self.path == "/flush_cache":
                self._send(200)
                return
            if self.path != "/generate":
                self._send(404, {"error": self.path})
                return
            with lock:
                received.append(payload)
            sampling = payload.get("sampling_params") or {}
            want_logprob = bool(payload.get("return_logprob"))
            text = payload.get("text")
            if isinstance(text, list):
                rooms = payload.get("bootstrap_room") or [None] * len(text)
                self._send(200, [reply_for(t, sampling, r, want_logprob) for t, r in zip(text, rooms)])
            else:
                self._send(200, reply_for(text, sampling, payload.get("bootstrap_room"), want_logprob))

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"stand-in {args.disaggregation_mode} server on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
