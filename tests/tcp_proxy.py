"""A TCP proxy for fault injection, run as its own process: it forwards to a real server until a
test stalls it (SIGSTOP: connections open and even new ones accepted by the kernel, but no byte
answered, like a hung server) or kills it (SIGKILL: connections reset, new ones refused, like a
dead server). `python -m tests.tcp_proxy PORT TARGET_HOST TARGET_PORT`."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from tests.conftest import free_port


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while True:
            ready, _, _ = select.select([a, b], [], [])
            for src in ready:
                data = src.recv(65536)
                if not data:
                    return
                (b if src is a else a).sendall(data)
    except OSError:
        pass
    finally:
        a.close()
        b.close()


def serve(port: int, target: tuple[str, int]) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()


class TcpProxy:
    """Forwards 127.0.0.1:port to the target; stall() / unstall() / kill() / start() change that for real."""

    def __init__(self, target_host: str, target_port: int, port: int | None = None):
        self.target_host, self.target_port = target_host, target_port
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> TcpProxy:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.tcp_proxy", str(self.port), self.target_host,
                                      str(self.target_port)], cwd=root)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the proxy did not start listening")

    def stall(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def unstall(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


if __name__ == "__main__":
    serve(int(sys.argv[1]), (sys.argv[2], int(sys.argv[3])))
