"""A model server for this machine: an exported model over HTTP with the OpenAI-compatible API of KServe's Hugging
Face server.

Run (`gpu-train serve --local` starts it; it needs `pip install ".[serve-local]"`):
    python -m trainer.model_server --model runs/make-train/export --name make-train --port 8001
    curl -s localhost:8001/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "make-train", "prompt": "def ", "max_tokens": 16}'

Routes: POST /v1/completions (and /openai/v1/completions, KServe's path), GET /v1/models (and /openai/v1/models),
GET /v1/models/<name> (ready or not, KServe's readiness route), GET /health, GET /metrics (prometheus_client).
A completion takes `prompt` (a string or a list of strings), `max_tokens`, `temperature` (0 = greedy),
`top_p`, `stop` and `seed`, and answers OpenAI's `text_completion` object with `usage` and a `finish_reason` of
`stop` (end-of-text or a stop string) or `length`. `usage.completion_tokens` counts the tokens generated up to
the end-of-text token or the one that completes a stop string. A request that does not fit the model's context
(max_tokens of the context's length or more, capped at one less; a prompt too long for the tokens asked for, cut
from its start) is answered with a `warnings` list beside OpenAI's fields saying so, and one log line.

Why a server of its own, not KServe's: KServe publishes its Python SDK on PyPI (`kserve`) but not its Hugging
Face server (`huggingfaceserver`), which exists only as the repository's source built into the runtime images
together with vLLM and a CUDA torch. This is a small FastAPI application over transformers' `generate` with the
same routes and answer shapes, so a request that works here works against the cluster's runtime. The model is
the export's Hugging Face GPT-2 layout (trainer/export.py) loaded with transformers' Auto classes; token ids
beyond the tokenizer's vocabulary (the model's embedding is padded past it) are never generated.

`--inject-errors FRACTION` answers that share of completions with HTTP 500 and `--inject-delay-ms MS` delays every
completion: they let a user rehearse a canary's rollback on this machine (docs/serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from gpu_train.serving.metrics import CONTENT_TYPE, ModelMetrics
from gpu_train.serving.ports import bind

COMPLETION_PATHS = ("/v1/completions", "/openai/v1/completions")


class CompletionRequest(BaseModel):
    model: str = ""
    prompt: str | list[str] = ""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None


class ModelError(RuntimeError):
    """An export this server cannot load; the message names the directory and what is missing."""


class LoadedModel:
    """An exported model and its tokenizer, answering one completion at a time (a lock: generate is CPU- or
    GPU-bound, and concurrent calls only slow each other down)."""

    def __init__(self, model_dir: Path, threads: int = 0) -> None:
        config = model_dir / "config.json"
        if not config.is_file():
            raise ModelError(f"{model_dir}: no config.json (not an exported model; python -m trainer.export writes "
                             "one)")
        if not (model_dir / "tokenizer.json").is_file():
            raise ModelError(f"{model_dir}: no tokenizer.json; re-export it with python -m trainer.export, which "
                             "writes one for every tokenizer")
        if threads:
            torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()  # one bar per load otherwise, on every server start
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        meta = json.loads(config.read_text()).get("gpu_train") or {}
        self.vocab = int((meta.get("tokenizer") or {}).get("vocab_size") or len(self.tokenizer))
        self.context = int(self.model.config.n_positions)
        self.eos = self.tokenizer.eos_token_id
        embedding = self.model.get_input_embeddings().weight.shape[0]
        self.suppress = list(range(self.vocab, embedding))
        self.lock = threading.Lock()

    def complete(self, prompt: str, req: CompletionRequest) -> tuple[str, str, int, int, list[str]]:
        """(text, finish reason, prompt tokens, completion tokens, warnings). The completion tokens are those
        generated up to the end-of-text token or up to the one that completed a stop string, not past it; the
        warnings say what of the request did not fit the model's context (max_tokens capped, the prompt cut)."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else [self.eos]
        budget = min(req.max_tokens, self.context - 1)
        warnings = []
        if budget < req.max_tokens:
            warnings.append(f"max_tokens {req.max_tokens} is more than the model's context of {self.context} tokens "
                            f"allows: at most {budget} tokens are generated")
        if len(ids) > self.context - budget:
            warnings.append(f"the prompt's {len(ids)} tokens and {budget} to generate exceed the model's context of "
                            f"{self.context} tokens: only the prompt's last {self.context - budget} tokens are read")
        ids = ids[-(self.context - budget):]
        x = torch.tensor([ids])
        sampling = {"do_sample": True, "temperature": req.temperature, "top_p": req.top_p} if req.temperature > 0 \
            else {"do_sample": False}
        with self.lock, torch.no_grad():
            if req.seed is not None:
                torch.manual_seed(req.seed)
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=budget,
                                      pad_token_id=self.eos, eos_token_id=self.eos,
                                      suppress_tokens=self.suppress or None, **sampling)
        new = out[0, len(ids):].tolist()
        finish = "stop" if self.eos in new else "length"
        if self.eos in new:
            new = new[:new.index(self.eos)]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        stops = [s for s in ([req.stop] if isinstance(req.stop, str) else list(req.stop or [])) if s]
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
            # Generation ends with the token that completes the stop string; the tokens after it are not counted.
            new = new[:next(k for k in range(1, len(new) + 1)
                            if any(s in self.tokenizer.decode(new[:k], skip_special_tokens=True) for s in stops))]
        return text, finish, len(ids), len(new), warnings


def create_app(model: LoadedModel, *, name: str, version: str, inject_errors: float = 0.0,
               inject_delay_ms: int = 0) -> FastAPI:
    metrics = ModelMetrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        print(f"gpu-train: model {name} version {version} is ready", file=sys.stderr, flush=True)
        yield

    app = FastAPI(title=f"gpu-train model server: {name}", lifespan=lifespan)

    @app.middleware("http")
    async def meter(request: Request, call_next):
        start = time.perf_counter()
        path = request.url.path
        if path in COMPLETION_PATHS:
            if inject_delay_ms:
                await asyncio.sleep(inject_delay_ms / 1000)
            if inject_errors and random.random() < inject_errors:
                response: Response = JSONResponse({"error": {"message": "injected error (--inject-errors)",
                                                             "type": "server_error"}}, status_code=500)
            else:
                response = await call_next(request)
            metrics.latency.labels(name, version).observe(time.perf_counter() - start)
        else:
            response = await call_next(request)
        metrics.requests.labels(name, version, path, str(response.status_code)).inc()
        response.headers["x-gpu-train-model-version"] = version
        return response

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "gpu-train"}]}

    def completions(req: CompletionRequest) -> dict[str, Any]:
        if req.model and req.model != name:
            raise HTTPException(404, f"model {req.model!r} is not served here (this server serves {name!r})")
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        choices, used, made, warnings = [], 0, 0, []
        for i, prompt in enumerate(prompts):
            text, finish, n_in, n_out, said = model.complete(prompt, req)
            choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": None})
            used, made = used + n_in, made + n_out
            warnings += [w for w in said if w not in warnings]
        metrics.tokens.labels(name, version).inc(made)
        answer = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                  "model": name, "choices": choices,
                  "usage": {"prompt_tokens": used, "completion_tokens": made, "total_tokens": used + made}}
        if warnings:  # beside OpenAI's fields, which clients read and leave the rest alone; and one log line
            answer["warnings"] = warnings
            print(f"gpu-train: model {name} version {version}: {'; '.join(warnings)}", file=sys.stderr, flush=True)
        return answer

    for prefix in ("", "/openai"):
        app.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])

    @app.get("/v1/models/{model_name}")
    def ready(model_name: str) -> dict[str, Any]:
        if model_name != name:
            raise HTTPException(404, f"model {model_name!r} is not served here")
        return {"name": name, "ready": True}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "version": version}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.model_server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="an exported model directory (python -m trainer.export)")
    ap.add_argument("--name", required=True, help="the model's name in the API (the service's name)")
    ap.add_argument("--version", default="local", help="the version label its metrics and answers carry")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="bound before the model loads; in use: exit 2")
    ap.add_argument("--fd", type=int, default=None, help="listen on this inherited socket instead of --host/--port "
                                                         "(gpu-train serve --local binds it first)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--inject-errors", type=float, default=0.0, metavar="FRACTION",
                    help="answer this share of completions with HTTP 500 (rehearse a rollback)")
    ap.add_argument("--inject-delay-ms", type=int, default=0, metavar="MS", help="delay every completion")
    args = ap.parse_args(argv)
    if not 0 <= args.inject_errors <= 1:
        ap.error(f"--inject-errors must be within 0..1 (got {args.inject_errors})")
    try:
        # The port first: one in use is an error now, not after the model has loaded.
        sock = socket.socket(fileno=args.fd) if args.fd is not None else bind(args.host, args.port)
        model = LoadedModel(args.model, threads=args.threads)
    except (ModelError, OSError, ValueError) as exc:  # PortError is a ValueError
        print(f"gpu-train: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    app = create_app(model, name=args.name, version=args.version, inject_errors=args.inject_errors,
                     inject_delay_ms=args.inject_delay_ms)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
