"""Shared pieces of the benchmarks: a local S3 server, free ports, timers and the results table.

Usage: imported by the bench sections; `with local_s3() as endpoint: ...` starts a moto server on
localhost (the same stand-in for object storage the tests use) and stops it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3

from trainer.distributed import free_port

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def local_s3(bucket: str = "bench") -> Iterator[str]:
    """A moto S3 server on localhost with one bucket; yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def median_time(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Median wall-clock seconds of `repeat` calls of fn."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Figure:
    """One measured figure, its reference measured in the same run, and the ratio of the two."""

    section: str
    name: str
    value: float | None
    unit: str
    reference: float | None = None
    reference_name: str = ""
    ratio: float | None = None
    target: str = ""
    meets_target: bool | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def preset_flops_per_token(preset: str) -> float:
    """Training FLOPs per token (6N + 12·L·H·Q·T) of a trainer preset; the model is built on the meta
    device, so no memory is allocated."""
    import torch

    from trainer import config as tcfg
    from trainer.flops import flops_per_token
    from trainer.model import GPT

    m = tcfg.PRESETS[preset]().model
    with torch.device("meta"):
        n = GPT(m).num_params(non_embedding=True)
    return flops_per_token(n, m.n_layer, m.n_head, m.d_model // m.n_head, m.context)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
