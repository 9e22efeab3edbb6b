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
