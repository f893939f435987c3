"""A fake reward server for the tests (importable as `reward_server`): the standard library's threading HTTP
server on 127.0.0.1 and a free port, in a thread, answering POST with what its `answer` callable says.

    with FakeRewardServer(answer) as server:      started and listening on entry, stopped on exit
        server.url                                 http://127.0.0.1:<port>/get_reward
        server.requests                            the decoded JSON bodies it received, in order
        server.headers                             each request's headers (a dict, names lower-case), in the same order

`answer(body) -> (status, reply)`: `reply` a JSON-able object (sent as JSON) or bytes (sent as they are); it may
sleep to play a slow server.
"""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def rewards_of(fn):
    """An `answer` that scores a request with the TRL-convention reward function `fn` over the request's
    `prompts`, `completions` and `labels` (as `answer`): {"rewards": [...]}, HTTP 200."""
    return lambda body: (200, {"rewards": [float(v) for v in fn(body["prompts"], body["completions"],
                                                                  answer=body["labels"])]})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeRewardServer:
    def __init__(self, answer, port: int = 0):
        self.answer, self.requests, self.headers, self.port = answer, [], [], port
        self._lock = threading.Lock()

    def __enter__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    outer.requests.append(body)
                    outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                status, reply = outer.answer(body)
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
