"""Ulysses sequence parallelism (`sequence_parallel_size`) trains like one process on the whole sequences.

One world-2 launch (SP2): zerotrain's GPT; the GPT through the Trainer at an odd length (padded with -100
labels); a Hugging Face
Llama with one key/value head (replicated over the two ranks) at an odd length with packed documents
(per-document positions); a GPT whose MLPs are zerotrain's expert-parallel MoE (experts split over the two
sequence-parallel ranks); the GPT saved at SP2 and resumed at SP1 x DP2; the GPT at ZeRO-3 with parameters and
optimizer state on NVMe (exact); the GPT at ZeRO-3 with ZeRO++ qgZ + LoCo + qwZ (lossy). One world-4 launch: SP2 x DP2 at
ZeRO-3 (and for the GPT also with hpZ and the optimizer offloaded to the CPU) and SP2 x TP2 for the GPT and a Llama with grouped-query attention (4 heads, 2 key/value heads: one per
tensor-parallel rank, replicated over the sequence-parallel pair) and the same Llama at SP4 (each key/value head
copied to the two ranks of its group); Qwen2 at SP2 x DP2 ZeRO-3 and Mistral at
SP2 x TP2 ZeRO-0; the GPT at SP2 x DP2 ZeRO-2 with qgZ + LoCo taking two hops (2 pretend nodes, lossy). Each
is compared with plain single-process AdamW on the whole sequences: losses within 1e-5 relative, weights rtol
1e-5 / atol 1e-6; the lossy ZeRO++ runs (6 steps at lr 1e-2, eps 1e-3) within 0.4% (losses) and 8% (relative L2
distance of the weights), which the do-nothing baseline (lr 0) misses by more than 2x. Head counts that do
not divide are refused before any process group exists, so that is tested in this process.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from models_for_tests import adamw_reference_steps, assert_same_training, assert_tolerance_discriminates

import transformers  # the dev extra has it: a missing install fails, never skips

STEPS, GLOBAL, SEQ, VOCAB, LR, CLIP = 2, 4, 16, 96, 1e-3, 1.0
EPS = 1e-4  # see tests/parallel/test_tensor_parallel_hf.py: keeps Adam from amplifying summation-order noise
ODD = 15  # a length two ranks do not divide: padded to 16
# ZeRO++ is lossy (int8 weights, int4 gradients): judged over longer training at a higher lr, against the
# do-nothing baseline (lr 0 on the same batches), see assert_tolerance_discriminates; Adam's eps 1e-3 there keeps
# it from turning int4 noise on tiny gradients into whole lr-sized steps (the weights measured: qgZ+LoCo+qwZ 4%,
# qgZ+LoCo in two hops 6%, the baseline 19%; the losses 0.1%, 0.2% and 1.2%)
LOSSY_STEPS, LOSSY_LR, LOSSY_EPS = 6, 1e-2, 1e-3
ZEROPP = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
          "zero_quantized_weights": True}


# --- models (fixed initial weights, no download) -----------------------------------------------------
def build_gpt(moe_comm=None):
    from zerotrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=SEQ, n_inner=48))
    if moe_comm is not None:
        for block in model.transformer.h:
            block.mlp = ExpertMLP(moe_comm)
    return model


class ExpertMLP(torch.nn.Module):
    """A GPT block's MLP as zerotrain's expert-parallel MoE (4 experts, top 2, no token dropped); its
    auxiliary loss depends on which tokens a rank holds, so it is left out."""

    def __init__(self, comm):
        from zerotrain.parallel.moe import ExpertParallelMoE

        super().__init__()
        torch.manual_seed(11)
        self.moe = ExpertParallelMoE(32, 48, 4, comm, top_k=2)

    def forward(self, x):
        return self.moe(x)[0]


HF = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
      "mistral": ("MistralConfig", "MistralForCausalLM")}


def build_llama(kv_heads: int, kind: str = "llama"):
    config_class, model_class = (getattr(transformers, name) for name in HF[kind])
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(config)


# --- data -----------------------------------------------------------------------------------------
def gpt_batches(steps: int, length: int):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (GLOBAL, length + 1), generator=generator) for _ in range(steps)]


def llama_batches(steps: int, length: int, packed: bool):
    """Token rows, and with `packed` per-document positions (documents of 6 and length - 6 tokens)."""
    generator = torch.Generator().manual_seed(6)
    positions = torch.arange(length)
    if packed:
        positions = torch.cat([torch.arange(6), torch.arange(length - 6)])
    return [(torch.randint(0, VOCAB, (GLOBAL, length), generator=generator), positions.expand(GLOBAL, length))
            for _ in range(steps)]


def forward(kind: str, model_or_engine, rows, sp=None):
    """The mean loss of one micro-batch (the whole group's under sequence parallelism)."""
    if kind == "gpt":
        batch = {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}
        if sp is not None:
            batch = sp.shard(batch, shift_labels=False)
            return model_or_engine(batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])[1]
        return model_or_engine(batch["input_ids"], batch["labels"])[1]
    ids, positions = rows
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}
    if sp is not None:
        batch = sp.shard(batch)
    # use_cache=False: transformers masks packed documents apart only without a cache (its training setup)
    return model_or_engine(**batch, use_cache=False).loss


# --- the runs ---------------------------------------------------------------------------------------
def make_engine(kind: str, sp: int, tp: int = 1, stage: int = 1, kv_heads: int = 2, moe: bool = False,
                lr: float = LR, eps: float = EPS, **zero):
    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    dp = int(os.environ["WORLD_SIZE"]) // (sp * tp)
    model = build_llama(kv_heads, kind) if kind in HF else None
    if kind == "gpt":
        moe_comm = None
        if moe:  # experts split over the ZeRO (data x sequence) ranks
            topology = Topology.build(timeout_seconds=60, sp_size=sp)
            moe_comm = Comm.data_parallel(topology).subgroup(*topology.expert_parallel_group(topology.dp_size))
        model = build_gpt(moe_comm)
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // dp, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "eps": eps}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                    "stage3_param_persistence_threshold": 0, **zero},
              "tensor_parallel": {"autotp_size": tp}, "sequence_parallel_size": sp,
              "steps_per_print": 0, "comm_timeout_seconds": 60}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    return engine


def train(engine, kind: str, data, first: int, last: int) -> list[float]:
    """Global steps [first, last): each data-parallel rank its share of the global batch, every rank of a
    sequence-parallel group the same rows; the global mean loss."""
    import torch.distributed as dist

    topology = engine.topology
    dp, rank = topology.data_parallel_size, topology.data_parallel_rank
    micro = GLOBAL // dp
    losses = []
    for rows in data[first:last]:
        mine = tuple(t[rank * micro:(rank + 1) * micro] for t in rows) if isinstance(rows, tuple) \
            else rows[rank * micro:(rank + 1) * micro]
        loss = forward(kind, engine, mine, engine.sequence_parallel)
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)  # sequence- and tensor-parallel ranks hold their data-parallel rank's loss
        losses.append(total.item() / dist.get_world_size())
    return losses


def world2(save_root: str) -> dict:
    results = {}
    engine = make_engine("gpt", sp=2)
    assert engine.topology.sp_size == 2 and engine.dp_world_size == 1 and engine.topology.dp_size == 2
    results["gpt"] = (train(engine, "gpt", gpt_batches(STEPS, SEQ), 0, STEPS), engine.full_state_dict())
    engine.save_checkpoint(save_root, tag="sp2")
    resumed = make_engine("gpt", sp=1, stage=2)
    assert resumed.dp_world_size == 2
    resumed.load_checkpoint(save_root, tag="sp2")
    results["gpt resumed at SP1 x DP2"] = (train(resumed, "gpt", gpt_batches(STEPS + 1, SEQ), STEPS, STEPS + 1),
                                           resumed.full_state_dict())
    engine = make_engine("gpt", sp=2, stage=2)
    # the Trainer slices each (x, y) micro-batch itself (an odd length: padded); DeepSpeed's loader gives both
    # ranks the same samples
    from zerotrain.trainer import Trainer
    trainer = Trainer(engine, dataloader=[(rows[:, :-1], rows[:, 1:]) for rows in gpt_batches(STEPS, ODD)],
                      total_steps=STEPS, steps_per_print=0)
    results["gpt Trainer odd"] = ([trainer.train_step()[0] for _ in range(STEPS)], engine.full_state_dict())
    results["loader indices"] = list(engine.deepspeed_io(list(range(64)), batch_size=1).sampler)
    engine = make_engine("llama", sp=2, stage=3, kv_heads=1)
    results["llama packed odd"] = (train(engine, "llama", llama_batches(STEPS, ODD, True), 0, STEPS),
                                   engine.full_state_dict())
    engine = make_engine("gpt", sp=2, stage=2, moe=True)
    results["gpt moe"] = (train(engine, "gpt", gpt_batches(STEPS, SEQ), 0, STEPS), engine.full_state_dict())
    # ZeRO-Infinity: parameters and optimizer state on NVMe, partitioned over the two sequence-parallel ranks
    nvme = {"device": "nvme", "nvme_path": os.path.join(save_root, "nvme"), "buffer_count": 2, "buffer_size": 2000,
            "max_in_cpu": 0}
    engine = make_engine("gpt", sp=2, stage=3, offload_param=nvme,
                         offload_optimizer={"device": "nvme", "nvme_path": nvme["nvme_path"]})
    results["gpt nvme"] = (train(engine, "gpt", gpt_batches(STEPS, SEQ), 0, STEPS), engine.full_state_dict())
    # ZeRO++ over the sequence-parallel pair (its ZeRO ranks): qgZ with LoCo and qwZ
    engine = make_engine("gpt", sp=2, stage=3, lr=LOSSY_LR, eps=LOSSY_EPS, **ZEROPP)
    results["gpt zero++"] = (train(engine, "gpt", gpt_batches(LOSSY_STEPS, SEQ), 0, LOSSY_STEPS),
                             engine.full_state_dict())
    results["zero++ collectives"] = sorted(engine.memory_report()["comm"])
    return results


def sp4_two_kv_heads() -> tuple:
    """The Llama (4 heads, 2 key/value heads) at SP4: each key/value head is copied to the two ranks of its
    query heads' group (kv head 0 to ranks 0-1, kv head 1 to ranks 2-3), not cycled over the ranks."""
    engine = make_engine("llama", sp=4, stage=1)
    assert (engine.topology.sp_size, engine.dp_world_size) == (4, 1)
    return train(engine, "llama", llama_batches(STEPS, SEQ, False), 0, STEPS), engine.full_state_dict()


def world4() -> dict:
    results = {}
    for kind in ("gpt", "llama"):
        data = gpt_batches(STEPS, SEQ) if kind == "gpt" else llama_batches(STEPS, SEQ, False)
        engine = make_engine(kind, sp=2, stage=3)
        assert (engine.topology.sp_size, engine.dp_world_size, engine.topology.dp_size) == (2, 2, 4)
        results[f"{kind} SP2 x DP2 ZeRO-3"] = (train(engine, kind, data, 0, STEPS), engine.full_state_dict())
        engine = make_engine(kind, sp=2, tp=2, stage=1)
        assert (engine.topology.sp_size, engine.topology.tp_size, engine.dp_world_size) == (2, 2, 1)
        results[f"{kind} SP2 x TP2"] = (train(engine, kind, data, 0, STEPS), engine.full_state_dict())
    results["llama SP4"] = sp4_two_kv_heads()
    # ZeRO-3 with hpZ's backward gathers inside each sequence-parallel pair, and the optimizer offloaded
    engine = make_engine("gpt", sp=2, stage=3, zero_hpz_partition_size=2,
                         offload_optimizer={"device": "cpu"})
    results["gpt SP2 x DP2 ZeRO-3 hpZ offload"] = (train(engine, "gpt", gpt_batches(STEPS, SEQ), 0, STEPS),
                                                   engine.full_state_dict())
    # qgZ's int4 gradients with LoCo reduced over the four ZeRO (data x sequence) ranks as two pretend nodes
    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "2"
    engine = make_engine("gpt", sp=2, stage=2, lr=LOSSY_LR, eps=LOSSY_EPS, zero_quantized_gradients=True,
                         zeropp_loco_param=ZEROPP["zeropp_loco_param"])
    results["gpt SP2 x DP2 ZeRO-2 qgZ+LoCo"] = (train(engine, "gpt", gpt_batches(LOSSY_STEPS, SEQ), 0, LOSSY_STEPS),
                                                engine.full_state_dict())
    results["qgZ collectives"] = sorted(engine.memory_report()["comm"])
    del os.environ["ZEROTRAIN_RANKS_PER_NODE"]
    # Qwen2 (q/k/v biases) and Mistral: the same attention registry, other modeling code
    data = llama_batches(STEPS, SEQ, False)
    engine = make_engine("qwen2", sp=2, stage=3)
    results["qwen2 SP2 x DP2 ZeRO-3"] = (train(engine, "qwen2", data, 0, STEPS), engine.full_state_dict())
    engine = make_engine("mistral", sp=2, tp=2, stage=0)
    results["mistral SP2 x TP2 ZeRO-0"] = (train(engine, "mistral", data, 0, STEPS), engine.full_state_dict())
    return results


@functools.lru_cache(maxsize=None)
def reference(kind: str, length: int = SEQ, packed: bool = False, kv_heads: int = 2, moe: bool = False,
              steps: int = STEPS, lr: float = LR, eps: float = EPS):
    """Plain single-process AdamW on the whole sequences: the losses of steps + 1 steps, the weights after
    `steps` steps and after steps + 1."""
    from zerotrain.comm import Comm

    model = build_gpt(Comm(None, 0, 1) if moe else None) if kind == "gpt" else build_llama(kv_heads, kind)
    data = gpt_batches(steps + 1, length) if kind == "gpt" else llama_batches(steps + 1, length, packed)
    losses, weights = adamw_reference_steps(model, data, functools.partial(forward, kind), lr, eps, CLIP)
    return losses, weights[steps - 1], weights[steps]


def check(where: str, got: tuple, want: tuple) -> None:
    """(losses, weights) of a run equal the single-process reference's at the project's fp32 tolerance."""
    assert_same_training(*got, *want, where=where)


def test_sequence_parallel_world2_trains_like_one_process_and_resumes_at_sp1(tmp_path):
    ranks = run_distributed(world2, 2, str(tmp_path), timeout=300)
    assert ranks[0]["loader indices"] == ranks[1]["loader indices"] and len(ranks[0]["loader indices"]) == 64
    results = ranks[0]
    losses, at_steps, after_one_more = reference("gpt")
    check("gpt SP2", results["gpt"], (losses[:STEPS], at_steps))
    check("gpt saved at SP2, resumed at SP1 x DP2", results["gpt resumed at SP1 x DP2"],
          (losses[STEPS:], after_one_more))
    losses, at_steps, _ = reference("gpt", ODD)
    check("gpt SP2 through the Trainer, odd length", results["gpt Trainer odd"], (losses[:STEPS], at_steps))
    losses, at_steps, _ = reference("llama", ODD, packed=True, kv_heads=1)
    check("llama SP2 (1 key/value head), packed, odd length", results["llama packed odd"],
          (losses[:STEPS], at_steps))
    losses, at_steps, _ = reference("gpt", moe=True)
    check("gpt with experts SP2", results["gpt moe"], (losses[:STEPS], at_steps))
    losses, at_steps, _ = reference("gpt")
    check("gpt SP2 ZeRO-3, parameters and optimizer on NVMe", results["gpt nvme"], (losses[:STEPS], at_steps))
    # the quantized collectives ran (int4 gradients, int8 weights), not their exact fallbacks
    assert {"reduce_scatter_q4", "all_gather_q8"} <= set(results["zero++ collectives"]), results["zero++ collectives"]
    check_zeropp("gpt SP2 ZeRO-3 qgZ+LoCo+qwZ", results["gpt zero++"], "gpt")


def check_zeropp(where: str, got: tuple, kind: str, tolerances: tuple = (4e-3, 0.08)) -> None:
    """A lossy ZeRO++ run: within tolerance of single-process training, which the do-nothing baseline (lr 0, the
    initial weights) is not."""
    losses, at_steps, _ = reference(kind, steps=LOSSY_STEPS, lr=LOSSY_LR, eps=LOSSY_EPS)
    still, initial, _ = reference(kind, steps=LOSSY_STEPS, lr=0.0)
    weights = {name: got[1][name] for name in at_steps}  # the state dict also names the tied head
    assert_tolerance_discriminates(where, (losses[:LOSSY_STEPS], at_steps), (got[0], weights),
                                   (still[:LOSSY_STEPS], initial), loss_tol=tolerances[0], weight_tol=tolerances[1])


def test_sequence_parallel_world4_with_data_parallel_zero3_and_tensor_parallel():
    results = run_distributed(world4, 4, timeout=400)[0]
    for kind in ("gpt", "llama"):
        losses, at_steps, _ = reference(kind)
        for shape in ("SP2 x DP2 ZeRO-3", "SP2 x TP2"):
            check(f"{kind} {shape}", results[f"{kind} {shape}"], (losses[:STEPS], at_steps))
    for kind, shape in (("qwen2", "SP2 x DP2 ZeRO-3"), ("mistral", "SP2 x TP2 ZeRO-0")):
        losses, at_steps, _ = reference(kind)
        check(f"{kind} {shape}", results[f"{kind} {shape}"], (losses[:STEPS], at_steps))
    losses, at_steps, _ = reference("llama")
    check("llama SP4 (2 key/value heads: each on 2 ranks)", results["llama SP4"], (losses[:STEPS], at_steps))
    losses, at_steps, _ = reference("gpt")
    check("gpt SP2 x DP2 ZeRO-3 hpZ offload", results["gpt SP2 x DP2 ZeRO-3 hpZ offload"], (losses[:STEPS], at_steps))
    assert {"reduce_scatter_q4_intra", "reduce_scatter_q4_inter"} <= set(results["qgZ collectives"])  # two hops
    check_zeropp("gpt SP2 x DP2 ZeRO-2 qgZ+LoCo", results["gpt SP2 x DP2 ZeRO-2 qgZ+LoCo"], "gpt")


def test_heads_that_do_not_divide_are_refused_naming_the_keys():
    from zerotrain.parallel.sequence import check_sequence_parallel

    with pytest.raises(ValueError, match=r"sequence_parallel_size: 4 x tensor_parallel.autotp_size: 2 = 8 does "
                                         r"not divide the 4 attention heads of GPT"):
        check_sequence_parallel(build_gpt(), 4, 2)
    with pytest.raises(ValueError, match=r"sequence_parallel_size: 2: the 3 key/value heads of LlamaForCausalLM"):
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3)
        check_sequence_parallel(transformers.LlamaForCausalLM(config), 2, 1)
    with pytest.raises(ValueError, match="needs zerotrain's GPT or a Hugging Face model"):
        check_sequence_parallel(torch.nn.Linear(2, 2), 2)
    check_sequence_parallel(build_llama(1), 2, 1)  # 1 key/value head: replicated, accepted
    check_sequence_parallel(build_llama(2), 2, 2)  # 1 per tensor-parallel rank: replicated, accepted


def test_shard_shifts_once_pads_odd_lengths_and_counts_the_real_targets():
    """The slices of every rank put together are the whole batch, shifted once (no target lost at the boundary),
    padded with -100 to a multiple of the group; the count is the whole micro-batch's real targets."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.sequence import SequenceParallel

    ids = torch.arange(2 * ODD).reshape(2, ODD) + 1
    labels = ids.clone()
    labels[1, :4] = -100  # a prompt that is not trained on
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # right padding: accepted
    labels[0, -2:] = -100
    shards = [SequenceParallel(Comm(None, rank, 2)).shard({"input_ids": ids, "labels": labels, "attention_mask": mask})
              for rank in range(2)]
    joined = {key: torch.cat([s[key] for s in shards], dim=1) for key in ("input_ids", "position_ids", "labels")}
    assert joined["input_ids"].shape == (2, 16) and joined["input_ids"][:, -1].eq(0).all()
    want = torch.nn.functional.pad(labels[:, 1:], (0, 2), value=-100)
    assert torch.equal(joined["labels"], want)
    assert shards[0]["labels"][0, -1] == ids[0, 8]  # rank 0's last token predicts rank 1's first
    assert torch.equal(joined["position_ids"], torch.arange(16).expand(2, 16))
    assert all(int(s["num_items_in_batch"]) == int((want != -100).sum()) == 12 + 11 for s in shards)
    left = torch.ones_like(ids)
    left[:, 0] = 0
    with pytest.raises(ValueError, match="right-padding mask"):
        SequenceParallel(Comm(None, 0, 2)).shard({"input_ids": ids, "attention_mask": left})


def test_sliding_window_longer_than_the_window_is_refused():
    """Mistral-style sliding-window attention is not applied under sequence parallelism: a sequence longer than
    the window is an error naming both (a sequence within it runs, the window then being moot)."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.sequence import SequenceParallel

    sp = SequenceParallel(Comm(None, 0, 1))
    query = key = value = torch.randn(1, 2, 8, 4)
    positions = torch.arange(8).unsqueeze(0)

    def original(module, q, k, v, mask, *args, **kwargs):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2), None

    module = torch.nn.Module()
    output, _ = sp.hf_attention(original, module, query, key, value, None, position_ids=positions, sliding_window=8)
    assert output.shape == (1, 8, 2, 4)
    with pytest.raises(ValueError, match="sliding_window is 4 and the sequence has 8 tokens"):
        sp.hf_attention(original, module, query, key, value, None, position_ids=positions, sliding_window=4)


def test_positions_packed_masks_and_the_group_mean_in_process():
    """What a rank computes without exchanging anything: its shard's global positions, the whole sequence's
    document mask from packed positions (computed once per forward: every layer hands the same tensor), and the
    loss averaged over the real targets (the whole micro-batch's count when given; 0, not nan, for none)."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.sequence import IGNORE_INDEX, SequenceParallel

    cpu = torch.device("cpu")
    assert torch.equal(SequenceParallel(Comm(None, 1, 2)).local_positions(8, cpu), torch.arange(8, 16).unsqueeze(0))
    assert torch.equal(SequenceParallel(Comm(None, 0, 2)).local_positions(8, cpu), torch.arange(8).unsqueeze(0))
    sp = SequenceParallel(Comm(None, 0, 1))
    unpacked = torch.arange(6).expand(2, 6)
    full, mask = sp.gathered_positions(unpacked)
    assert torch.equal(full, unpacked) and mask is None, "unpacked: plain causal attention, no mask"
    packed = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])  # documents of 3, 2, 1 tokens; one of 6
    documents = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    want = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    for row in range(2):
        for i in range(6):
            for j in range(i + 1):
                want[row, 0, i, j] = bool(documents[row, i] == documents[row, j])
    full, mask = sp.gathered_positions(packed)
    assert torch.equal(full, packed) and torch.equal(mask, want), mask
    assert sp.gathered_positions(packed)[1] is mask, "the same positions again: the mask of this forward, not rebuilt"
    assert sp.gathered_positions(unpacked)[1] is None, "new positions: a new mask"

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    targets = torch.randint(0, 7, (2, 5), generator=generator)
    targets[0, :2] = IGNORE_INDEX
    flat_logits, flat_targets = logits.reshape(-1, 7), targets.reshape(-1)
    torch.testing.assert_close(sp.causal_lm_loss(logits, targets),
                               F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX))
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(sp.causal_lm_loss(logits, targets, torch.tensor(16)), total / 16)
    one = torch.full_like(targets, IGNORE_INDEX)
    one[1, 3] = targets[1, 3] = 2
    torch.testing.assert_close(sp.causal_lm_loss(logits, one), F.cross_entropy(logits[1, 3:4], one[1, 3:4]))
    assert sp.causal_lm_loss(logits, torch.full_like(targets, IGNORE_INDEX)).item() == 0.0


def test_the_attention_wrapper_hands_the_whole_sequence_and_restores_the_module():
    """hf_attention (one rank: nothing exchanged) calls transformers' function with the gathered positions and
    their mask in place of the local mask, num_key_value_groups set to the heads it is given and put back after,
    even when the function fails; the output comes back as (B, S, heads, D)."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.sequence import SequenceParallel

    sp = SequenceParallel(Comm(None, 0, 1))
    query, key, value = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    seen = {}

    def original(module, q, k, v, mask, *args, **kwargs):
        seen.update(groups=module.num_key_value_groups, mask=mask, positions=kwargs["position_ids"], args=args)
        if kwargs.get("fail"):
            raise RuntimeError("attention failed")
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                                attn_mask=mask).transpose(1, 2), "weights"

    module = torch.nn.Module()
    module.num_key_value_groups = 99  # whatever the model set: only the call sees the heads it is given
    output, weights = sp.hf_attention(original, module, query, key, value, "the local mask", "dropout",
                                      position_ids=packed)
    assert weights is None and output.shape == (1, 6, 4, 8)
    assert seen["groups"] == 2 and module.num_key_value_groups == 99 and seen["args"] == ("dropout",)
    assert torch.equal(seen["positions"], packed)
    assert seen["mask"].shape == (1, 1, 6, 6) and not seen["mask"][0, 0, 3, :3].any() and seen["mask"][0, 0, 3, 3]
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    causal[3:, :3] = False
    want = torch.nn.functional.scaled_dot_product_attention(query, key.repeat_interleave(2, 1),
                                                            value.repeat_interleave(2, 1), attn_mask=causal)
    torch.testing.assert_close(output, want.transpose(1, 2))
    with pytest.raises(RuntimeError, match="attention failed"):
        sp.hf_attention(original, module, query, key, value, None, position_ids=packed, fail=True)
    assert module.num_key_value_groups == 99, "restored after a failure"
    with pytest.raises(ValueError, match="got no position_ids"):
        sp.hf_attention(original, module, query, key, value, None)


def test_a_wrapped_hf_model_on_one_rank_computes_what_the_model_does():
    """enable_sequence_parallel on a Llama (eager attention: switched to sdpa, the same math) over a group of one:
    the loss of the sharded batch and the logits without positions (supplied by the pre-hook) are the model's own;
    labels not passed through shard are refused; enabling again does not wrap the registry's function twice."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zerotrain.comm import Comm
    from zerotrain.parallel.sequence import enable_sequence_parallel

    def eager_llama():
        model = build_llama(2)
        model.config._attn_implementation = "eager"
        return model

    model, plain = eager_llama(), eager_llama()
    sp = enable_sequence_parallel(model, Comm(None, 0, 1))
    assert model.config._attn_implementation == "sdpa"
    wrapper = ALL_ATTENTION_FUNCTIONS["sdpa"]
    enable_sequence_parallel(eager_llama(), Comm(None, 0, 1))
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapper, "wrapped once"
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    loss = model(**sp.shard({"input_ids": ids, "labels": ids})).loss
    torch.testing.assert_close(loss, plain(input_ids=ids, labels=ids, use_cache=False).loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids, use_cache=False).logits,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="labels given without shift_labels and num_items_in_batch"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(ValueError, match="found no attention module"):
        enable_sequence_parallel(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16)), Comm(None, 0, 1))
