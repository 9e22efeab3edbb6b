"""Sample text from a trained model.

Run:
    python -m trainer.sample --run-dir runs/make-train --prompt "def " --max-tokens 200
    python -m trainer.sample --checkpoint runs/x/checkpoints/step_000000200 --temperature 0.8 --top-k 40
    python -m trainer.sample --model-dir runs/x/export --num-samples 3 --seed 1

The model comes from the newest verified checkpoint of ``--run-dir`` (a newer one that does not verify is
named in one warning line), a ``--checkpoint`` step directory or an exported ``--model-dir`` (see
``trainer.export``, which does the loading). Prompts are encoded and samples decoded with the tokenizer the
training dataset was prepared with, which the checkpoint (or the exported directory) carries: sampling needs
neither the dataset nor its store (``--data-uri`` reads a dataset's tokenizer instead).

Decoding is autoregressive over the last ``model.context`` tokens: logits of the last position divided by
``--temperature`` (0 picks the most likely token), restricted to the ``--top-k`` most likely, then sampled
with a seeded generator, so a seed gives the same text every time. Ids the model
has beyond the tokenizer's vocabulary (its padded rows) are never sampled; a sample stops at the
end-of-text token unless ``--no-stop``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from trainer.model import GPT


def generate(
    model: GPT,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    vocab_limit: int | None = None,
    stop_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Token ids that continue ``prompt`` (the prompt not included); pure given the generator's state.

    Runs the model on whatever device its parameters are on; sampling happens on the CPU.
    """
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (got {temperature})")
    device = next(model.parameters(), torch.empty(0)).device
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_tokens):
                logits, _ = model(ids[:, -model.cfg.context :])
                last = logits[0, -1].float().cpu()  # sampled on the CPU, with the CPU generator
                if vocab_limit is not None and vocab_limit < last.numel():
                    last[vocab_limit:] = float("-inf")
                if temperature == 0:
                    nxt = int(torch.argmax(last))
                else:
                    last = last / temperature
                    if top_k > 0 and top_k < last.numel():
                        kth = torch.topk(last, top_k).values[-1]
                        last[last < kth] = float("-inf")
                    probs = torch.softmax(last, dim=-1)
                    nxt = int(torch.multinomial(probs, 1, generator=generator))
                out.append(nxt)
                if stop_id is not None and nxt == stop_id:
                    break
                ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    finally:
        model.train(was_training)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.sample", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", type=Path, help="a run directory: its newest verified checkpoint")
    src.add_argument("--checkpoint", type=Path, help="one checkpoint step directory")
    src.add_argument("--model-dir", type=Path, help="an exported (or registered) model directory")
    ap.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40, help="0: no top-k cut")
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    ap.add_argument("--data-uri", default=None,
                    help="a dataset whose tokenizer to use instead of the one the checkpoint carries")
    ap.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint for --data-uri")
    args = ap.parse_args(argv)
    for name in ("max_tokens", "num_samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0 or args.top_k < 0:
        ap.error("--temperature and --top-k must be >= 0")

    from trainer.data.errors import DataError
    from trainer.export import ExportError, load, warn_line

    try:
        loaded = load(run_dir=args.run_dir, checkpoint=args.checkpoint, model_dir=args.model_dir,
                      data_uri=args.data_uri, endpoint_url=args.endpoint_url,
                      warn=warn_line("python -m trainer.sample"))  # fmt: skip
        tok = loaded.tokenizer.build()
    except (ExportError, DataError) as exc:
        print(f"python -m trainer.sample: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if tok.vocab_size > loaded.cfg.vocab_size:
        print(f"python -m trainer.sample: error: tokenizer has {tok.vocab_size} ids but the model only "
              f"{loaded.cfg.vocab_size}", file=sys.stderr)  # fmt: skip
        return 2
    prompt = tok.encode(args.prompt).tolist() if args.prompt else [tok.eot_id]
    gen = torch.Generator().manual_seed(args.seed)
    where = loaded.origin.get("checkpoint") or loaded.origin.get("model_dir")
    print(f"# {where} (step {loaded.origin.get('step', '?')}), temperature {args.temperature}, "
          f"top-k {args.top_k}, seed {args.seed}", file=sys.stderr)  # fmt: skip
    for i in range(args.num_samples):
        ids = generate(
            loaded.model, prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
            vocab_limit=tok.vocab_size, stop_id=None if args.no_stop else tok.eot_id, generator=gen,
        )  # fmt: skip
        if i:
            print("-" * 40)
        print(args.prompt + tok.decode(ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
