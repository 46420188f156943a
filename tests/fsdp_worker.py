"""The worker of tests/test_fsdp.py: run by `torchrun --nproc_per_node 2` (gloo, CPU), it trains a small
BertImplForMaskedLM sharded with FSDP2 (`fully_shard` on each BertImplLayer, then the root) and, on rank 0,
the same steps unsharded in one process on the same global batch; it writes what it measured to
OUT/results.json, and tests/test_fsdp.py asserts on it. Every model of a scenario (the sharded one, the one-process
one, the resumed one) is built the same way: the plain model, then `hf_bert_impl.kernelize(model, ...)` with the
scenario's kernels (as the package's scripts do, before Trainer / accelerate shard it). Scenarios (3 AdamW steps each):

  default              kernelize(model) (kernels "auto"): per-step losses, first-step gradients and gathered weights
                       vs one process; the full state dict gathered on rank 0 -> save_pretrained -> from_pretrained ->
                       the same outputs; a sharded checkpoint (torch.distributed.checkpoint, model + optimizer) after
                       step 2, loaded into a fresh sharded model, resumed -> the uninterrupted run's weights
  plain                never kernelized: the model file alone (the padded batch, masked), as a Hub user runs it
  unpadded_sparse      kernels "unpadded" forced, and the model option config.sparse_prediction (logits for the
                       labelled tokens only); as default
  bf16                 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) vs the float32 one-process run
  accelerate_grouping  kernels "unpadded" forced; the tied word embeddings + decoder in one group, as accelerate 1.15's
                       FSDP2 groups them
and `embeddings_apart_error`: what FSDP2 says when BertImplEmbeddings is a group apart from the tied decoder.

Run: python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_worker.py OUT   (the repository on PYTHONPATH)
"""

import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hf_bert_impl import BertImplConfig, BertImplForMaskedLM, kernelize, kernelized


VOCAB, GLOBAL_BATCH, SEQ, STEPS, CHECKPOINT_STEP, LR = 99, 8, 9, 3, 2, 3e-3


def global_batches(steps: int):
    """`steps` padded global batches (GLOBAL_BATCH, SEQ): row i keeps SEQ - (i % 4) tokens (4 lengths, so unpadding
    matters), about a third of the real tokens carry an MLM label; the same on every rank (one seeded generator)."""
    g = torch.Generator().manual_seed(2024)
    out = []
    for _ in range(steps):
        lengths = torch.tensor([SEQ - (i % 4) for i in range(GLOBAL_BATCH)])
        mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) * mask
        pick = (torch.rand(GLOBAL_BATCH, SEQ, generator=g) < 0.35) & mask.bool()
        pick[:, 1] = True  # every row has a label
        words = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        labels = torch.where(pick, words, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def make_config(**overrides) -> BertImplConfig:
    kw = {"vocab_size": VOCAB, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    kw.update(overrides)
    return BertImplConfig.from_preset("debug", **kw)


def build(config: BertImplConfig, state: dict | None, kernels: dict | None) -> BertImplForMaskedLM:
    """The plain model with `state` loaded, kernelized with `kernels` (kernelize's keyword arguments; None: plain)."""
    model = BertImplForMaskedLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model if kernels is None else kernelize(model, **kernels)


def local(batch: dict, rank: int, world: int) -> dict:  # this rank's rows of the global batch
    n = GLOBAL_BATCH // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def shard(
    model: BertImplForMaskedLM, mp: MixedPrecisionPolicy | None = None, grouping: str = "layers"
) -> BertImplForMaskedLM:
    """fully_shard each BertImplLayer, then the root. grouping="accelerate": as accelerate 1.15's FSDP2 preparation
    with transformer_layer_cls_to_wrap=["BertImplLayer"]: the layers, then the tied pair (word embeddings, decoder) as
    one group kept unsharded after forward, then the root."""
    kw = {} if mp is None else {"mp_policy": mp}
    for layer in model.bert.layers:
        fully_shard(layer, **kw)
    if grouping == "accelerate":
        fully_shard([model.get_input_embeddings(), model.get_output_embeddings()], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)
    return model


def embeddings_apart_error(config) -> str:
    """What FSDP2 says when BertImplEmbeddings gets its own group (accelerate's default wrap: the model's
    _no_split_modules) while the decoder shares its weight: the error text, or "" if it trained."""
    model = BertImplForMaskedLM(config)
    try:
        fully_shard(model.bert.embeddings)
        shard(model, grouping="accelerate")
        model(**local(global_batches(1)[0], dist.get_rank(), dist.get_world_size())).loss.backward()
    except Exception as e:  # noqa: BLE001  recorded, asserted by the test
        return f"{type(e).__name__}: {e}"
    return ""


def full_weights(model) -> dict:
    """The whole model's weights as plain CPU tensors, gathered on every rank (a sharded model) or as they are."""
    sharded = any(type(p) is not torch.nn.Parameter and hasattr(p, "full_tensor") for p in model.parameters())
    if dist.is_initialized() and sharded:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        return {k: v.detach().float().clone() for k, v in sd.items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def sharded_step(model, optim, batch, rank, world, seen=None) -> float:
    """One AdamW step of a sharded model on this rank's half of `batch`. The loss is that of the global batch (the
    ranks' masked-token sums over the global count, as Trainer's num_items_in_batch); FSDP averages gradients over the
    ranks, hence the x world. `seen` (a dict) gets the logits' shape and the full gradients (gathered) of this step."""
    n_items = batch["labels"].ne(-100).sum()
    out = model(**local(batch, rank, world), num_items_in_batch=n_items)
    (out.loss * world).backward()
    if seen is not None:
        seen["logits_shape"] = list(out.logits.shape)
        seen["grads"] = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
    optim.step()
    optim.zero_grad(set_to_none=True)
    loss = out.loss.detach().float().clone()
    dist.all_reduce(loss)  # the global batch's loss
    return float(loss)


def single_step(model, optim, batch, seen=None) -> float:
    out = model(**batch)
    out.loss.backward()
    if seen is not None:
        seen["grads"] = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    if optim is not None:
        optim.step()
        optim.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def relative(a: dict, b: dict) -> float:  # max |a - b| over all tensors, relative to max |b|
    return max_diff(a, b) / max(float(v.abs().max()) for v in b.values())


def scenario(
    name, config, init_state, batches, rank, world, out_dir, kernels, checkpoint=False, mp=None, grouping="layers"
) -> dict:
    t0, res = time.time(), {}
    if rank == 0:  # one process, unsharded, the global batches (rank 0 alone: it needs no communication)
        ref = build(config, init_state, kernels)
        opt, ref_seen = torch.optim.AdamW(ref.parameters(), lr=LR), {}
        res["single_losses"] = [single_step(ref, opt, b, ref_seen if i == 0 else None) for i, b in enumerate(batches)]
        ref_weights = full_weights(ref)
        res["single_moved"] = max_diff(ref_weights, {k: v.float() for k, v in init_state.items()})
        if mp is not None:  # the error scale of bf16 itself: the same weights cast to bf16, one process, first batch
            cast, cast_seen = build(config, init_state, kernels), {}
            res["plain_bf16_loss"] = single_step(cast.to(mp.param_dtype), None, batches[0], cast_seen)
            res["plain_bf16_grad_error"] = relative(cast_seen["grads"], ref_seen["grads"])
    # FSDP2: 2 processes, each half of every global batch
    model = build(config, init_state, kernels)
    res["kernelized"] = sorted(set(kernelized(model).values()))  # the kernel functions put on the model
    layer_inputs = []
    model.bert.layers[0].register_forward_pre_hook(
        lambda m, args: layer_inputs.append([list(args[0].shape), str(args[0].dtype)])
    )
    shard(model, mp, grouping)
    res["sharded"] = all(
        type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel() for p in model.parameters()
    )
    res["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    opt, seen, losses = torch.optim.AdamW(model.parameters(), lr=LR), {}, []
    for step, b in enumerate(batches, 1):
        losses.append(sharded_step(model, opt, b, rank, world, seen if step == 1 else None))
        if checkpoint and step == CHECKPOINT_STEP:  # a sharded checkpoint: each rank writes its shards
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.save(state, checkpoint_id=os.path.join(out_dir, f"{name}_dcp"))
            at_checkpoint = full_weights(model)
    first = local(batches[0], rank, world)
    res.update(
        fsdp_losses=losses,
        logits_shape=seen["logits_shape"],
        layer0_input=layer_inputs[0],
        local_real_tokens=int(first["attention_mask"].sum()),
        local_labels=int(first["labels"].ne(-100).sum()),
        local_rows=len(first["labels"]),
        seq=SEQ,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        optimizer_state_dtypes=sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim()}),
    )
    weights = full_weights(model)
    if rank == 0:
        res["grad_vs_single"] = relative(seen["grads"], ref_seen["grads"])
        res["weights_vs_single"] = max_diff(weights, ref_weights)
        k = max(weights, key=lambda k: float((weights[k] - ref_weights[k]).abs().max()))
        res["weights_vs_single_where"] = k
        res["update_vs_single"] = (
            sum(float((weights[k] - ref_weights[k]).norm() ** 2) for k in weights)
            / sum(float((ref_weights[k] - init_state[k].float()).norm() ** 2) for k in weights)
        ) ** 0.5
    if checkpoint:
        # the full state dict, gathered on rank 0 (CPU) -> save_pretrained -> from_pretrained: the same outputs
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        probe = {k: v for k, v in batches[0].items() if k != "labels"}
        with torch.no_grad():
            sharded_logits = model(**probe).logits.float()
        if rank == 0:
            gathered = BertImplForMaskedLM(config)  # the plain model: kernelize saves exactly what it saves
            gathered.load_state_dict(full, strict=True)
            path = os.path.join(out_dir, f"{name}_saved")
            gathered.save_pretrained(path)
            loaded = BertImplForMaskedLM.from_pretrained(path).eval()
            with torch.no_grad():
                plain_logits = loaded(**probe).logits
                loaded_logits = (loaded if kernels is None else kernelize(loaded, **kernels))(**probe).logits
                ref_logits = ref.eval()(**probe).logits
            res["full_state_dict_keys"] = sorted(full)
            res["reloaded_vs_sharded_logits"] = float((loaded_logits - sharded_logits).abs().max())
            res["reloaded_vs_single_logits"] = float((loaded_logits - ref_logits).abs().max())
            res["reloaded_plain_vs_sharded_logits"] = float((plain_logits - sharded_logits).abs().max())
            res["sharded_logits_max"] = float(sharded_logits.abs().max())
            res["reloaded_vs_gathered_weights"] = max_diff(full_weights(loaded), weights)
        # resume: a fresh sharded model and optimizer load the step-2 checkpoint and run the remaining steps
        fresh = shard(build(config, None, kernels))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
        before_load = full_weights(fresh)
        state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(state, checkpoint_id=os.path.join(out_dir, f"{name}_dcp"))
        set_model_state_dict(fresh, state["model"])
        set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
        loaded_weights = full_weights(fresh)
        res["resumed_losses"] = [sharded_step(fresh, fresh_opt, b, rank, world) for b in batches[CHECKPOINT_STEP:]]
        resumed = full_weights(fresh)
        res.update(
            resumed_vs_uninterrupted=max_diff(resumed, weights),
            loaded_vs_checkpoint=max_diff(loaded_weights, at_checkpoint),
            fresh_vs_checkpoint=max_diff(before_load, at_checkpoint),
            resumed_moved=max_diff(resumed, at_checkpoint),
        )
    res["seconds"] = round(time.time() - t0, 2)
    return res


def main(out_dir: str) -> None:
    faulthandler.enable()  # a crash (SIGSEGV) prints every thread's Python stack to stderr
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert GLOBAL_BATCH % world == 0
    torch.manual_seed(0)
    batches = global_batches(STEPS)
    results = {"world_size": world, "torch": torch.__version__}
    config = make_config()
    torch.manual_seed(0)
    init_state = {k: v.clone() for k, v in BertImplForMaskedLM(config).state_dict().items()}
    for name, kernels, kw in [  # kernels: kernelize's keyword arguments (None: the plain model)
        ("default", {}, {"checkpoint": True}),  # kernels "auto": it unpads this padded batch
        ("plain", None, {}),  # the model file alone: the padded batch, masked
        ("unpadded_sparse", {"kernels": "unpadded"}, {"checkpoint": True}),  # and config.sparse_prediction
        ("bf16", {}, {"mp": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}),
        ("accelerate_grouping", {"kernels": "unpadded"}, {"grouping": "accelerate"}),
    ]:
        scenario_config = make_config(sparse_prediction=True) if name == "unpadded_sparse" else config
        results[name] = scenario(name, scenario_config, init_state, batches, rank, world, out_dir, kernels, **kw)
        if rank == 0:
            print(name, json.dumps(results[name]), flush=True)
    results["embeddings_apart_error"] = embeddings_apart_error(make_config())
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
