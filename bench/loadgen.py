"""A lean closed-loop HTTP/1.1 load generator for loopback servers.

    python bench/loadgen.py URL --body-file F [-c 32] [--duration 10] [--warmup 2] [--json]

Each of ``c`` clients holds one keep-alive connection and sends the same pre-built request
bytes, waits for the whole reply, and sends the next. Nothing is parsed but the status
line and Content-Length, so the generator spends its CPU on sockets, not JSON: on a
2-core machine whatever it uses is taken from the server, and it reports its own CPU
share so that cost is visible next to every figure. Targets must be loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import resource
import socket
import sys
import time
from typing import Awaitable, Callable
from urllib.parse import urlsplit


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def check_loopback(host: str) -> None:
    for info in socket.getaddrinfo(host, None):
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            sys.exit(f"refusing non-loopback target {host}")


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    body = await reader.readexactly(length) if length else b""
    return status, body


async def _client(host: str, port: int, request: bytes, stop: float, record: list, errors: dict,
                  measure_from: float, expect: bytes | None, max_requests: int = 0) -> None:
    reader = writer = None
    while time.perf_counter() < stop and not (max_requests and len(record) >= max_requests):
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            started = time.perf_counter()
            writer.write(request)
            status, body = await asyncio.wait_for(_read_reply(reader), 30)
            done = time.perf_counter()
            ok = status == 200 and (expect is None or expect in body)
            if started >= measure_from:
                if ok:
                    record.append(done - started)
                else:
                    errors[str(status)] = errors.get(str(status), 0) + 1
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            if time.perf_counter() >= measure_from:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            if writer is not None:
                writer.close()
            writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run(url: str, body: bytes, concurrency: int, duration: float, warmup: float,
              expect: bytes | None = None, max_requests: int = 0) -> dict:
    """One closed-loop run; stops after ``duration`` s of measurement or ``max_requests`` OK replies."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    check_loopback(host)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    await asyncio.sleep(0)
    return await closed_loop(lambda stop, record, errors, measure_from: _client(
        host, port, request, stop, record, errors, measure_from, expect, max_requests), concurrency, duration, warmup)


async def closed_loop(client: Callable[[float, list, dict, float], Awaitable[None]], concurrency: int,
                      duration: float, warmup: float) -> dict:
    """Run ``concurrency`` copies of ``client(stop, record, errors, measure_from)`` (each
    appends its latencies to ``record`` and counts failures in ``errors``) and sum them up:
    shared by this generator and bench/h2load.py."""
    start = time.perf_counter()
    measure_from, stop = start + warmup, start + warmup + duration
    record: list[float] = []
    errors: dict[str, int] = {}
    tasks = [asyncio.create_task(client(stop, record, errors, measure_from)) for _ in range(concurrency)]
    await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
    cpu0 = _cpu()
    await asyncio.gather(*tasks)
    cpu = _cpu() - cpu0
    duration = min(duration, time.perf_counter() - measure_from)
    lat = sorted(record)
    return {
        "concurrency": concurrency, "ok": len(lat), "errors": sum(errors.values()), "error_kinds": errors,
        "rps": round(len(lat) / duration, 1),
        "p50_ms": round(percentile(lat, 0.50) * 1000, 3), "p90_ms": round(percentile(lat, 0.90) * 1000, 3),
        "p99_ms": round(percentile(lat, 0.99) * 1000, 3), "max_ms": round((lat[-1] if lat else 0) * 1000, 3),
        "client_cpu_s": round(cpu, 3), "client_cpu_pct": round(100 * cpu / duration, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--body-file", required=True)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--expect", help="substring every 200 body must contain")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with open(a.body_file, "rb") as f:
        body = f.read()
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(run(a.url, body, a.concurrency, a.duration, a.warmup,
                             a.expect.encode() if a.expect else None))
    print(json.dumps(result) if a.json else
          f"c={result['concurrency']} {result['rps']} req/s p50={result['p50_ms']} ms p99={result['p99_ms']} ms "
          f"errors={result['errors']} client_cpu={result['client_cpu_pct']}%")


if __name__ == "__main__":
    main()
