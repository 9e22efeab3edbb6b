"""The parallel layout: degrees at a world size, the checks that refuse an impossible layout naming its setting (in
the trainer's schema and at plan/submit time), the pipeline's micro batches and the memory a GPU needs.

Run: .venv/bin/pytest tests/gpu_train/sizing/test_layout.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.sizing.job import layout_problems, memory_line
from gpu_train.sizing.layout import (
    Layout,
    LayoutError,
    micro_batches,
    pipeline_runs,
    rank_stages,
    resolve_layout,
    stage_layers,
    world_problems,
)
from gpu_train.sizing.memory import (
    RECOMMENDED_LAYOUTS,
    fitting_micro_batch,
    memory_per_gpu,
    memory_problem,
    sized,
)
from gpu_train.spec.errors import ConfigError
from gpu_train.spec.job import job_problems, read_job
from gpu_train.spec.trainer_config import PRESETS, build_config
from tests.gpu_train.spec.test_job import SPEC, Pool, Team

SMALL = ["model.n_layer=4", "model.d_model=8", "model.n_head=2", "model.context=4", "model.vocab_size=16",
         "model.pos=learned", "model.norm=layernorm", "train.micro_batch_size=2", "train.global_batch_tokens=64"]


def cfg(*overrides: str):
    return build_config("tiny", overrides=[*SMALL, *overrides])


def test_data_parallelism_takes_what_tp_and_pp_leave():
    assert resolve_layout(cfg("train.tp=2", "train.pp=2").train, 8) == Layout(pp=2, dp_replicate=2, dp_shard=1, tp=2)
    fsdp = cfg("train.parallel=fsdp", "train.dp_shard=2", "train.dp_replicate=-1").train
    assert resolve_layout(fsdp, 8) == Layout(pp=1, dp_replicate=4, dp_shard=2, tp=1)
    assert resolve_layout(cfg("train.parallel=fsdp", "train.tp=2").train, 8) == Layout(1, 1, 4, 2)
    assert Layout(2, 3, 4, 2).dp == 12 and Layout(2, 3, 4, 2).world == 48


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.tp=3"], "train.tp=3: model.n_head 2 is not divisible by 3"),
    (["train.tp=4"], "train.tp=4: model.n_head 2 is not divisible by 4"),
    (["train.pp=3"], "train.pp=3: model.n_layer 4 does not split into 3 stages of equal size"),
    (["train.pp=2", "train.pp_schedule=interleaved_1f1b"],
     "train.pp_schedule=interleaved_1f1b needs train.pp_stages_per_rank >= 2"),
    (["train.pp=2", "train.pp_microbatches=1"], "train.pp_microbatches=1 is fewer than the train.pp=2 stages"),
    (["train.pp_microbatches=4"], "train.pp_microbatches=4 needs train.pp > 1"),
    (["train.dp_shard=2"], "splitting data parallelism into shard and replicate groups needs train.parallel=fsdp"),
    (["train.tp=0"], "train.tp must be >= 1 (got 0)"),
])
def test_a_layout_that_cannot_work_at_any_world_size_is_refused_naming_the_setting(overrides, message):
    with pytest.raises(ConfigError) as err:
        cfg(*overrides)
    assert message in str(err.value)


def test_world_problems_name_the_setting_to_change():
    # 16 sequences per step: at world 8 with tp=2, dp=4 x micro batch 2 = 8 divides; at world 12, dp=6 does not.
    assert world_problems(cfg("train.tp=2"), 8, gpus_per_node=8) == []
    ((setting, text),) = world_problems(cfg("train.tp=2"), 12, gpus_per_node=4)
    assert setting == "train.global_batch_tokens" and "data-parallel degree 6" in text
    assert world_problems(cfg("train.tp=2"), 6, gpus_per_node=3)[0][0] == "train.tp"  # a group spans two nodes
    assert world_problems(cfg("train.pp=2"), 3)[0] == (
        "train.pp", "world size 3 is not a multiple of train.pp x train.tp = 2 x 1 = 2")
    fsdp = cfg("train.parallel=fsdp", "train.dp_shard=3", "train.dp_replicate=-1")
    assert world_problems(fsdp, 4)[0][0] == "train.dp_shard"


def test_pipeline_micro_batches_come_from_the_global_batch():
    # 16 sequences, pp=2 on 4 GPUs: dp=2, 16 / (2 x 2) = 4 micro batches per data-parallel rank.
    c = cfg("train.pp=2")
    layout = resolve_layout(c.train, 4)
    assert micro_batches(c, layout) == 4
    assert pipeline_runs(c, layout) == (4, 1)  # all four in one schedule run
    assert pipeline_runs(cfg("train.pp=2", "train.pp_microbatches=2"), layout) == (2, 2)
    with pytest.raises(LayoutError) as err:  # 16 / (8 x 2) = 1 micro batch per run, fewer than 2 stages
        pipeline_runs(c, resolve_layout(c.train, 16))
    assert err.value.setting == "train.micro_batch_size"


def test_stages_are_consecutive_blocks_and_interleaved_ranks_hold_every_pp_th():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert rank_stages(1, 2, 2) == [1, 3] and rank_stages(0, 4, 1) == [0]


def test_the_chunked_loss_keeps_one_chunk_of_logits():
    """gpt2-124m at micro batch 16: 16 x 1024 tokens; chunks of 8192 tokens keep 8192 x 50304 x 10 bytes of logits,
    whole logits twice that; under tensor parallelism the trainer computes the loss on vocabulary shards instead."""
    whole, chunked, tp = (build_config("gpt2-124m", overrides=["train.micro_batch_size=16", *o]) for o in (
        ["train.loss_chunk_tokens=0"], ["train.loss_chunk_tokens=8192"], ["train.loss_chunk_tokens=8192", "train.tp=2"]))
    assert memory_per_gpu(chunked, resolve_layout(chunked.train, 1)).logits == 8192 * 50304 * 10
    assert memory_per_gpu(whole, resolve_layout(whole.train, 1)).logits == 16384 * 50304 * 10
    assert memory_per_gpu(tp, resolve_layout(tp.train, 2)).logits == 16384 * 50304 * 10 / 2


def test_auto_micro_batch_is_the_largest_that_divides_the_step_and_fits():
    """The tiny model of test_memory_estimate_by_hand at 16 sequences per step on one worker: 64000 bytes at micro
    batch 2, of which 3376 x 16 = 54016 are fixed and 4 x 2176 + 1280 = 9984 grow with it (4992 per sequence), so
    micro batch b needs 54016 + 4992 b bytes. With 90% of 110000 bytes = 99000 usable, b <= 9.01: 8, the largest
    divisor of 16 under that; 4 at 90000 (b <= 5.4); none at 60000 (b = 1 needs 59008 > 54000)."""
    c = cfg("train.micro_batch_size=auto")
    assert c.train.micro_batch_size == "auto"
    assert fitting_micro_batch(c, 1, 110000) == 8 and fitting_micro_batch(c, 1, 90000) == 4
    assert sized(c, 1, 110000).train.micro_batch_size == 8
    assert sized(cfg(), 1, 10).train.micro_batch_size == 2  # a number stays as it is
    # At world size 4 each worker has 4 sequences of the step: nothing larger divides it.
    assert fitting_micro_batch(c, 4, 1e12) == 4
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=auto: even the smallest micro batch needs about "
                                          r"0.0 GB .* at world size 1, more than 90% of 0.0 GB; raise train.tp"):
        fitting_micro_batch(c, 1, 60000)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=auto: no micro batch fits the layout at world "
                                          r"size 3: .*train.global_batch_tokens / model.context = 16 sequences"):
        fitting_micro_batch(c, 3, 1e12)
    with pytest.raises(ConfigError, match="train.micro_batch_size: expected an integer or auto, got 'most'"):
        cfg("train.micro_batch_size=most")


def test_memory_estimate_by_hand():
    """4 blocks of d=8, MLP 4d, LayerNorm: 12 x 64 matrix entries + 2 norms x 16 = 800 per block; embeddings
    16 x 8 tokens + 4 x 8 positions = 160; final norm 16: 3376 parameters x 16 bytes. Activations: 34 x (2 x 4
    tokens) x 8 x 2 bytes / 2 = 2176 per block x 4 blocks; logits: 8 tokens x 16 x 10 bytes = 1280."""
    c = cfg()
    est = memory_per_gpu(c, resolve_layout(c.train, 1))
    assert (est.parameters, est.gradients, est.optimizer) == (3376 * 4, 3376 * 4, 3376 * 8)
    assert (est.gathered, est.activations, est.logits) == (0, 4 * 2176, 1280)
    assert est.total == 64000
    # pp=2 (GPipe), tp=2, FSDP over 2 at world 8: a stage holds 2 blocks + embeddings + the output copy is not
    # counted twice (max(160, 128)) + norm 16 = 1776 / tp 2 / dp_shard 2 = 444; two gathered blocks 2 x 800 / 2 x
    # 6 bytes = 4800; micro batches 16 / (dp 2 x 2) = 4 in flight x 2 blocks x 34 x 8 x 8 / 2 = 8704; logits 640.
    p = cfg("train.pp=2", "train.tp=2", "train.parallel=fsdp", "train.pp_schedule=gpipe")
    est = memory_per_gpu(p, resolve_layout(p.train, 8))
    assert est.total == 444 * 16 + 4800 + 8704 + 640
    # 1F1B keeps at most pp = 2 micro batches in flight instead of 4.
    one = cfg("train.pp=2", "train.tp=2", "train.parallel=fsdp", "train.pp_schedule=1f1b")
    assert memory_per_gpu(one, resolve_layout(one.train, 8)).activations == 8704 / 2


# Peak memory the trainer reported (summary.json's peak_memory_gb) on one H100 80GB, bf16 + torch.compile, one micro
# batch per step: docs/performance.md, "GPU" (preset, micro batch, train.parallel, GB). They were measured with the
# whole logits, before the chunked output layer and loss, so they are compared with train.loss_chunk_tokens=0.
H100_PEAKS = [("gpt2-124m", 16, "ddp", 12.9), ("gpt2-124m", 16, "fsdp", 11.6), ("gpt2-124m", 32, "ddp", 23.4),
              ("gpt2-350m", 8, "ddp", 16.5), ("gpt2-350m", 8, "fsdp", 13.5)]


@pytest.mark.parametrize(("preset", "micro", "parallel", "peak_gb"), H100_PEAKS)
def test_the_estimate_is_never_below_a_peak_measured_on_a_gpu_and_at_most_a_third_above(preset, micro, parallel,
                                                                                        peak_gb):
    """The estimate refuses layouts before a node starts, so it must not promise less than a real run needs; far
    above the real peak it would refuse layouts that fit."""
    c = build_config(preset, overrides=[f"train.micro_batch_size={micro}", f"train.global_batch_tokens={micro * 1024}",
                                        f"train.parallel={parallel}", "train.precision=bf16",
                                        "train.loss_chunk_tokens=0"])
    estimate_gb = memory_per_gpu(c, resolve_layout(c.train, 1)).total / 1e9
    assert peak_gb <= estimate_gb <= 4 / 3 * peak_gb, (estimate_gb, peak_gb)


def test_the_recommended_layouts_fit_and_plain_data_parallelism_does_not():
    for preset, by_gpu in RECOMMENDED_LAYOUTS.items():
        for gpus, overrides in by_gpu.items():
            c = build_config(preset, overrides=[f"{k}={str(v).lower()}" for k, v in overrides.items()])
            for gpu in gpus:
                layout = resolve_layout(c.train, 16 if gpu in ("L4", "A10G", "L40S") else 64)
                assert memory_problem(c, layout, gpu, preset=preset) is None, (preset, gpu)
    ddp = build_config("gpt2-2.7b", overrides=["train.parallel=ddp", "train.dp_shard=-1", "train.dp_replicate=1"])
    problem = memory_problem(ddp, resolve_layout(ddp.train, 8), "L4", preset="gpt2-2.7b")
    assert problem is not None and "train.pp=4" in problem  # it names the recommended layout for L4
    assert "gpt2-2.7b" in PRESETS


def test_plan_time_errors_name_the_job_setting():
    def problems(spec: dict, pool: Pool = Pool()) -> list[str]:
        job = read_job(spec, key="job")
        return (job_problems(job, pools=[pool], teams=[Team(gpu_quota={pool.name: 64})], scheme="s3://", key="job")
                + layout_problems(job, pools=[pool], key="job"))

    base = {**SPEC, "nodes": "1:2"}
    (p,) = problems({**base, "overrides": {**SPEC["overrides"], "train.tp": 5}})
    assert p.startswith("job.overrides.train.tp: the trainer refuses it: train.tp=5: model.n_head 12")
    (p,) = problems({**base, "overrides": {**SPEC["overrides"], "train.tp": 16, "model.n_head": 16}})
    assert p.startswith("job.overrides.train.tp: the layout does not fit world size 8 (1 node x 8 GPUs")
    assert "more than the 8 GPUs of a node" in p
    (p,) = problems({**base, "overrides": {**SPEC["overrides"], "train.pp": 3}})
    assert p.startswith("job.overrides.train.pp: the layout does not fit world size 8")
    # The memory a GPU needs, against the pool's GPUs: gpt2-2.7b on one 24 GB L4 node of 8 (plain DDP).
    l4 = Pool(name="l4", instance_type="g6.48xlarge", gpu_type="L4")
    (p,) = problems({**base, "pool": "l4", "preset": "gpt2-2.7b", "overrides": {"train.parallel": "ddp",
                     "train.dp_shard": -1, "train.dp_replicate": 1}, "globalBatchTokens": 1048576}, l4)
    assert p.startswith("job.pool 'l4': at world size 8") and "more than 90% of a L4's 24 GB" in p


def test_auto_micro_batch_is_chosen_at_submit_for_the_pools_gpus():
    """SPEC's 786432 tokens are 768 sequences; at MIN 2 nodes x 8 GPUs each worker has 48, and gpt2-124m at 48
    sequences of 1024 tokens (about 21 GB) fits an H100's 80 GB, so auto is 48 there. gpt2-2.7b's parameters,
    gradients and moments alone (about 43 GB) do not fit a 24 GB L4 under plain DDP at any micro batch."""
    auto = {**SPEC, "overrides": {"train.micro_batch_size": "auto"}}
    job = read_job(auto, key="job")
    assert job_problems(job, pools=[Pool()], teams=[Team(gpu_quota={"h100": 64})], scheme="s3://", key="job") == []
    assert layout_problems(job, pools=[Pool()], key="job") == []
    assert "x tp=1, train.micro_batch_size=auto: 48 at world size 16 (MIN" in memory_line(job, gpus=8, gpu_type="H100")
    l4 = Pool(name="l4", instance_type="g6.48xlarge", gpu_type="L4")
    big = read_job({**auto, "pool": "l4", "preset": "gpt2-2.7b", "globalBatchTokens": 1048576, "overrides": {
        "train.micro_batch_size": "auto", "train.parallel": "ddp", "train.dp_shard": -1, "train.dp_replicate": 1}},
        key="job")
    assert job_problems(big, pools=[l4], teams=[Team(gpu_quota={"l4": 64})], scheme="s3://", key="job") == []
    (p,) = layout_problems(big, pools=[l4], key="job")
    assert p.startswith("job.overrides.train.micro_batch_size: train.micro_batch_size=auto: even the smallest "
                        "micro batch needs about ") and "at world size 16 (2 nodes x 8 GPUs" in p
    assert "more than 90% of 24.0 GB" in p


def test_submit_prints_the_memory_a_gpu_needs_at_min_nodes():
    job = read_job({**SPEC, "preset": "gpt2-2.7b", "nodes": "1:2", "globalBatchTokens": 1048576, "overrides": {}},
                   key="job")
    line = memory_line(job, gpus=8, gpu_type="H100")
    c = build_config("gpt2-2.7b", overrides=["train.global_batch_tokens=1048576"])
    want = memory_per_gpu(c, Layout(pp=1, dp_replicate=1, dp_shard=8, tp=1)).total / 1e9
    assert line.startswith(f"memory: ~{want:.1f} GB (") and "per GPU of a H100's 80 GB" in line
    assert line.endswith("under pp=1 x dp_replicate=1 x dp_shard=8 x tp=1 at world size 8 (MIN 1 node x 8 GPUs), "
                         "where a GPU holds the most")
