"""A real network path on one machine: a network namespace for the server, joined by a veth pair whose
two ends carry the kernel's ``tbf`` rate limit. Needs root and iproute2 (``ip``, ``tc``); ``available()``
says whether this machine can. The wire byte counters of the client's end count what the path carried,
TCP/IP headers and ACKs included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class NetnsLink:
    def __init__(self, name: str = "specdec-edge", rate_mbit: float | None = None, subnet: str = "10.213.7"):
        self.name, self.rate_mbit = name, rate_mbit
        self.client_dev, self.server_dev = f"{name[:8]}-c", f"{name[:8]}-s"
        self.client_ip, self.server_ip = f"{subnet}.1", f"{subnet}.2"

    @staticmethod
    def available() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "network namespaces need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"{tool} (iproute2) is not installed"
        return True, ""

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def _shape(self, dev: str, inside: bool) -> None:
        if not self.rate_mbit:
            return
        burst = max(16_000, int(self.rate_mbit * 1e6 / 8 / 100))  # >= 10 ms of traffic
        cmd = [
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{self.rate_mbit:g}mbit",
            "burst",
            str(burst),
            "latency",
            "200ms",
        ]
        _ip(*(self.exec_prefix + cmd if inside else cmd))

    def __enter__(self) -> "NetnsLink":
        self.close()
        try:
            _ip("ip", "netns", "add", self.name)
            _ip("ip", "link", "add", self.client_dev, "type", "veth", "peer", "name", self.server_dev)
            _ip("ip", "link", "set", self.server_dev, "netns", self.name)
            _ip("ip", "addr", "add", f"{self.client_ip}/24", "dev", self.client_dev)
            _ip("ip", "link", "set", self.client_dev, "up")
            for cmd in (
                ["ip", "addr", "add", f"{self.server_ip}/24", "dev", self.server_dev],
                ["ip", "link", "set", self.server_dev, "up"],
                ["ip", "link", "set", "lo", "up"],
            ):
                _ip(*self.exec_prefix, *cmd)
            self._shape(self.client_dev, inside=False)
            self._shape(self.server_dev, inside=True)
        except subprocess.CalledProcessError as exc:
            self.close()
            raise RuntimeError(
                f"setting up namespace {self.name!r} failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}"
            ) from exc
        return self

    def wire_bytes(self) -> tuple[int, int]:
        """(sent, received) bytes on the client's end of the veth pair."""
        base = Path("/sys/class/net") / self.client_dev / "statistics"
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())

    def close(self) -> None:
        _ip("ip", "netns", "del", self.name, check=False)
        _ip("ip", "link", "del", self.client_dev, check=False)

    def __exit__(self, *exc) -> None:
        self.close()
