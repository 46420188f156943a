"""Each formula of the seed against an independent evaluation of the formula itself.

Tolerances (docs/formulas.md): float32 results within 1e-5 absolute of a float64 reference on unit-scale
activations; the positional encoding within 1e-6.
"""

import math

import pytest
import torch
import torch.nn as nn

from hf_bert_impl import BertImplForMaskedLM, kernelize, kernelized
from hf_bert_impl.modeling_bert_impl import (
    BertImplEncoder,
    BertImplSelfAttention,
    eager_attention_forward,
    masked_lm_loss,
    sinusoidal_position_encoding,
)


@pytest.mark.parametrize("num_positions,dim", [(64, 32), (50, 17), (600, 8), (1, 1)])
def test_sinusoidal_matches_formula_float64(num_positions, dim):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), evaluated
    element by element with Python floats (float64)."""
    pe = sinusoidal_position_encoding(num_positions, dim)
    assert pe.shape == (num_positions, dim) and pe.dtype == torch.float32
    expected = torch.empty(num_positions, dim, dtype=torch.float64)
    for pos in range(num_positions):
        for col in range(dim):
            two_i = col - (col % 2)
            angle = pos / 10000 ** (two_i / dim)
            expected[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    assert (pe.double() - expected).abs().max().item() <= 1e-6


def _reference_attention_float64(q, k, v, mask):
    """softmax(QKᵀ/√d_k + M) V, in float64, with the softmax written as exp / sum."""
    q, k, v, mask = (t.double() for t in (q, k, v, mask))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask
    weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    probs = weights / weights.sum(dim=-1, keepdim=True)
    return probs @ v, probs


def test_eager_attention_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 3, 4, 7, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    keep = torch.ones(b, s)
    keep[1, 5:] = 0  # row 1 has 5 real tokens
    mask = (1.0 - keep[:, None, None, :]) * torch.finfo(torch.float32).min  # (b, 1, 1, s)
    module = nn.Module().eval()
    out, probs = eager_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    ref_out, ref_probs = _reference_attention_float64(q, k, v, mask)
    assert out.shape == (b, s, h, d)  # transformers' layout for attention outputs
    assert (out.double() - ref_out.transpose(1, 2)).abs().max().item() <= 1e-5
    assert (probs.double() - ref_probs).abs().max().item() <= 1e-6
    assert probs[1, :, :, 5:].abs().max().item() == 0.0  # padding gets exactly zero weight
    torch.testing.assert_close(probs.sum(-1), torch.ones(b, h, s), atol=1e-6, rtol=0)


class SeedMultiHeadAttention(nn.Module):
    """A textbook `MultiHeadAttention` after Vaswani et al. (2017), section 3.2.2, as the article this project follows
    writes it, with an optional additive padding mask: separate W_q, W_k, W_v, W_o maps of d_model, split into h heads,
    scaled scores, softmax, concat, W_o."""

    def __init__(self, d_model=512, h=8):
        super().__init__()
        self.d_k = d_model // h
        self.h = h
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        batch_size = x.size(0)
        Q = self.W_q(x)
        K = self.W_k(x)
        V = self.W_v(x)
        Q = Q.view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
        K = K.view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
        V = V.view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores + mask
        attention = torch.softmax(scores, dim=-1)
        context = torch.matmul(attention, V)
        context = context.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        return self.W_o(context)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_multihead_matches_seed_reference(debug_config, batch, backend):
    config = debug_config()
    config._attn_implementation = backend
    torch.manual_seed(0)
    ours = BertImplSelfAttention(config).eval()
    for p in ours.parameters():  # non-trivial biases too
        nn.init.normal_(p, std=0.3)
    seed = SeedMultiHeadAttention(d_model=config.hidden_size, h=config.num_attention_heads).eval()
    w_q, w_k, w_v = ours.Wqkv.weight.chunk(3, dim=0)
    b_q, b_k, b_v = ours.Wqkv.bias.chunk(3, dim=0)
    with torch.no_grad():
        pairs = (
            (seed.W_q, w_q, b_q),
            (seed.W_k, w_k, b_k),
            (seed.W_v, w_v, b_v),
            (seed.W_o, ours.Wo.weight, ours.Wo.bias),
        )
        for lin, w, bias in pairs:
            lin.weight.copy_(w)
            lin.bias.copy_(bias)
    _, attention_mask, _ = batch
    x = torch.randn(attention_mask.shape[0], attention_mask.shape[1], config.hidden_size)
    mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    with torch.no_grad():
        got, _ = ours(x, mask)  # the plain model: the padded batch, masked
        want = seed(x, mask)
    assert (got - want).abs().max().item() <= 1e-5
    # the speed layer's "unpadded" (kernels_bert_impl.py) runs the encoder on the real tokens only, as one packed row
    # (1, T, H) in which each sequence attends to itself: the same formula on the real tokens
    encoder = BertImplEncoder(config).eval()
    encoder[0].attn = ours
    kernelize(encoder, "unpadded")
    assert kernelized(encoder)[""] == "unpadded_encoder_forward"
    assert kernelized(encoder)["0.attn.attention_function"] == "attention_function"  # per sequence: ours, unmasked
    seen = []
    ours.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    with torch.no_grad():
        encoder(x, attention_mask)
    real = attention_mask.bool()
    assert seen[0].shape == (1, int(real.sum()), config.hidden_size)
    assert (seen[0][0] - want[real]).abs().max().item() <= 1e-5


def test_mlm_loss_matches_hand_computation(debug_config):
    """L = -Σ log P(x_i | x_\\i) over masked positions, divided by their count (or by
    num_items_in_batch), computed from the logits with Python floats."""
    config = debug_config()
    torch.manual_seed(0)
    model = BertImplForMaskedLM(config).eval()
    input_ids = torch.randint(1, config.vocab_size, (3, 7))
    labels = torch.full_like(input_ids, -100)
    masked = [(0, 1), (0, 4), (1, 0), (2, 6), (2, 2)]
    for i, j in masked:
        labels[i, j] = int(input_ids[i, j])
    with torch.no_grad():
        out = model(input_ids, labels=labels)
        out_items = model(input_ids, labels=labels, num_items_in_batch=torch.tensor(8))
    logits = out.logits.double()
    nll = 0.0
    for i, j in masked:
        row = logits[i, j].tolist()
        log_z = math.log(sum(math.exp(z) for z in row))
        nll += -(row[labels[i, j].item()] - log_z)
    assert abs(out.loss.item() - nll / len(masked)) <= 1e-5
    assert abs(out_items.loss.item() - nll / 8) <= 1e-5
    # No masked position: a finite zero, not NaN.
    none_masked = masked_lm_loss(out.logits, torch.full_like(labels, -100))
    assert none_masked.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mlm_loss_of_half_precision_logits(dtype):
    """Half-precision logits are not cast to float32 as a whole: per-token losses in their dtype,
    summed in float32. Loss and logit gradients are checked against the float64 loss of the same
    (rounded) logits: each within 3x the error of transformers' way (cross-entropy mean in the
    logits' dtype) plus one rounding step of the dtype, and the float32 path is the cross-entropy of
    the masked rows within float32 rounding."""
    torch.manual_seed(0)
    logits = (torch.randn(6, 40, 1000) * 3).to(dtype)
    labels = torch.randint(0, 1000, (6, 40))
    labels[torch.rand(labels.shape) > 0.15] = -100
    n = labels.ne(-100).sum()
    ref_in = logits.double().requires_grad_()
    ref = nn.functional.cross_entropy(ref_in.view(-1, 1000), labels.view(-1), ignore_index=-100)
    ref.backward()
    ours_in, hf_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = masked_lm_loss(ours_in, labels)
    hf = nn.functional.cross_entropy(hf_in.view(-1, 1000), labels.view(-1), ignore_index=-100)
    assert ours.dtype == torch.float32 and hf.dtype == dtype
    ours.backward()
    hf.backward()
    eps = torch.finfo(dtype).eps
    assert abs(ours.item() - ref.item()) <= 3 * abs(hf.item() - ref.item()) + eps * ref.item()
    grad_err = (ours_in.grad.double() - ref_in.grad).abs().max().item()
    assert grad_err <= 3 * (hf_in.grad.double() - ref_in.grad).abs().max().item() + 1e-6
    # float32: the cross-entropy of the masked rows over their count (float64 here), within float32 summation
    # rounding (1e-6 relative: a few ulps of a sum of ~40 terms)
    logits32, keep = logits.float().view(-1, 1000), labels.view(-1).ne(-100)
    expected = nn.functional.cross_entropy(logits32[keep].double(), labels.view(-1)[keep], reduction="sum") / n
    assert abs(masked_lm_loss(logits32, labels).item() - expected.item()) <= 1e-6 * expected.item()


def test_pretraining_loss_matches_hand_computation(debug_config):
    """L = L_MLM + L_NSP. Under gradient accumulation (num_items_in_batch = N masked tokens over all
    micro-batches) the MLM sum is divided by N and the NSP mean is weighted by this micro-batch's share
    n / N of the masked tokens, so the micro-batch losses add up to N-weighted terms."""
    from hf_bert_impl import BertImplForPreTraining

    config = debug_config()
    torch.manual_seed(0)
    model = BertImplForPreTraining(config).eval()
    input_ids = torch.randint(1, config.vocab_size, (3, 7))
    labels = torch.full_like(input_ids, -100)
    masked = [(0, 1), (1, 3), (2, 5), (2, 0)]
    for i, j in masked:
        labels[i, j] = int(input_ids[i, j])
    nsp_labels = torch.tensor([0, 1, 1])
    with torch.no_grad():
        out = model(input_ids, labels=labels, next_sentence_label=nsp_labels)
        out_items = model(
            input_ids, labels=labels, next_sentence_label=nsp_labels, num_items_in_batch=torch.tensor(10)
        )

    def nll(row, target):  # -log softmax(row)[target], Python floats
        return -(row[target] - math.log(sum(math.exp(z) for z in row)))

    logits, nsp_logits = out.prediction_logits.double(), out.seq_relationship_logits.double()
    mlm_sum = sum(nll(logits[i, j].tolist(), int(labels[i, j])) for i, j in masked)
    nsp_mean = sum(nll(nsp_logits[i].tolist(), int(nsp_labels[i])) for i in range(3)) / 3
    assert abs(out.loss.item() - (mlm_sum / len(masked) + nsp_mean)) <= 1e-5
    assert abs(out_items.loss.item() - (mlm_sum / 10 + nsp_mean * len(masked) / 10)) <= 1e-5
