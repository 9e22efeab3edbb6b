"""Model shapes, tied embeddings, causality, norm and position variants.

Run: .venv/bin/pytest tests/trainer/test_model.py -q
"""

from __future__ import annotations

import pytest
import torch

from gpu_train.spec.trainer_config import ModelConfig
from trainer.model import GPT


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_shapes_loss_and_causality(norm, pos):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, context=12, vocab_size=40, norm=norm, pos=pos)
    model = GPT(cfg)
    x = torch.randint(0, 40, (3, 12))
    logits, loss = model(x, targets=x)
    assert logits.shape == (3, 12, 40)
    assert loss.shape == () and torch.isfinite(loss)
    # Changing the last token must not change any earlier position's logits (causal attention).
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 40
    logits2, _ = model(x2)
    torch.testing.assert_close(logits[:, :-1], logits2[:, :-1])
    assert not torch.allclose(logits[:, -1], logits2[:, -1])
    norm_cls = torch.nn.RMSNorm if norm == "rmsnorm" else torch.nn.LayerNorm
    assert isinstance(model.norm_f, norm_cls)
    assert (model.pos_emb is None) == (pos == "rope")


def test_embeddings_are_tied_and_counted_once():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, context=8, vocab_size=50)
    model = GPT(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    total = model.num_params(non_embedding=False)
    assert total == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert total - model.num_params(non_embedding=True) == 50 * 16 + 8 * 16


def test_rejects_sequences_longer_than_context():
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, context=8, vocab_size=50))
    with pytest.raises(ValueError, match="model.context 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, context=8, vocab_size=30)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    b.activation_checkpointing = True
    x = torch.randint(0, 30, (2, 8))
    for m in (a, b):
        m(x, targets=x)[1].backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, msg=name)


@pytest.mark.parametrize("chunk", [5, 16, 1000])
def test_the_chunked_loss_gives_the_whole_logits_loss_and_gradients(chunk):
    """train.loss_chunk_tokens: the loss in chunks of tokens (one that does not divide the 24 tokens, one that
    does, one larger than them) against the loss of the whole logits, and every parameter's gradient."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, context=12, vocab_size=40)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    b.loss_chunk_tokens = chunk
    x, y = torch.randint(0, 40, (2, 12)), torch.randint(0, 40, (2, 12))
    logits, loss_a = a(x, targets=y)
    none, loss_b = b(x, targets=y)
    assert logits is not None and none is None  # the chunked path never builds the logits
    torch.testing.assert_close(loss_b, loss_a)
    (loss_a * 0.5).backward()
    (loss_b * 0.5).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, msg=name)
    assert b(x)[0] is not None  # without targets (evaluation, sampling) the logits as before


def test_the_chunked_loss_runs_its_matmuls_in_the_autocast_dtype():
    torch.manual_seed(0)
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    y = torch.randint(0, 10, (6,))
    from trainer.model import chunked_lm_loss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_lm_loss(h, w, y, 4)
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref)  # both from bf16 logits
    loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_the_attention_setting_picks_one_kernel_on_cuda_and_torch_choice_elsewhere():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.runner import sdpa_backends

    assert sdpa_backends("flash", "cuda") == [SDPBackend.FLASH_ATTENTION]
    assert sdpa_backends("cudnn", "cuda") == [SDPBackend.CUDNN_ATTENTION]
    assert sdpa_backends("auto", "cuda") is None
    assert sdpa_backends("flash", "cpu") is None
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, context=8, vocab_size=30))
    x = torch.randint(0, 30, (2, 8))
    with sdpa_kernel([SDPBackend.MATH]):  # what train.attention=math runs, on a CPU too
        loss = model(x, targets=x)[1]
    torch.testing.assert_close(loss, model(x, targets=x)[1])
