"""Whole-step CUDA graphs: the same training as the eager step (weights, losses, dropout masks), exact
resume, the eager fallback past the graph budget; on the CPU, the choice and its errors."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bertctl.checkpoints import training
from bertctl.config import MIN_SHAPE_STEPS, FinetuneConfig
from bertctl.errors import BertctlError
from bertctl.tasks import trainer as T
from bertctl.train import graphs as G
from bertctl.train.engine import _plain_lr, load_optimizer_state
from test_finetune_trainer import _setup

cuda = pytest.mark.cuda


def _run(build, feats, **kw):
    # every shape captured (these runs are too short for the default graph_min_steps)
    cfg = dict(epochs=2, lr=1e-3, batch_size=8, device="cuda", show_progress=False, attn="sdpa", log_every=1,
               graph_min_steps=1)
    cfg.update(kw)
    log_records = []

    class Log:
        def log(self, **rec):
            log_records.append(rec)

        def close(self):
            pass

    result = T.fine_tune(build(), feats, FinetuneConfig.of(**cfg), log=Log())
    losses = [r["loss"] for r in log_records if r.get("event") == "train"]
    if cfg.get("cuda_graphs") and cfg["graph_min_steps"] == 1:  # the graphs did run
        assert [r for r in log_records if r.get("event") == "cuda_graphs"][-1]["graphs"] > 0
    return result, losses


@cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [False, True], ids=["sequence", "token"])
@pytest.mark.parametrize("masks", ["torch", "fused"])
def test_graph_steps_train_as_the_eager_steps(tmp_path, precision, tokens, masks):
    """Dropout 0.1, batches of every length: the graphs replay the eager step's maths and masks, torch's (as
    fine-tuning draws them) or the fused sub-layer op's own."""
    build, feats = _setup(tmp_path, dropout=0.1, tokens=tokens, masks=masks)
    eager, eager_losses = _run(build, feats, precision=precision, cuda_graphs=False)
    graphed, graph_losses = _run(build, feats, precision=precision, cuda_graphs=True)
    assert len(graph_losses) == len(eager_losses) == graphed.steps == 10
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(eager.model.state_dict().items(), graphed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
    # Another seed gives other dropout masks under graphs too (the seed is read at each replay).
    other, other_losses = _run(build, feats, precision=precision, cuda_graphs=True, seed=7)
    assert other_losses != graph_losses


@cuda
@pytest.mark.parametrize("masks", ["torch", "fused"])
def test_dropout_masks_change_from_step_to_step_under_graphs(tmp_path, masks):
    """Two identical batches in a row at lr 0: eager and graphs see the same pair of different losses."""
    build, feats = _setup(tmp_path, dropout=0.3, masks=masks)
    same = [feats[0]] * 16
    _, eager = _run(build, same, epochs=1, lr=0.0, cuda_graphs=False)
    _, graphed = _run(build, same, epochs=1, lr=0.0, cuda_graphs=True)
    assert eager[0] != eager[1]
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-5, atol=1e-6)


@cuda
def test_graph_resume_is_exact(tmp_path):
    build, feats = _setup(tmp_path, dropout=0.1)
    cfg = FinetuneConfig.of(epochs=2, lr=1e-3, batch_size=8, device="cuda", show_progress=False, save_every=3,
                        attn="sdpa", cuda_graphs=True, graph_min_steps=1)
    straight = T.fine_tune(build(), feats, cfg, output_dir=tmp_path / "a")

    class Crash(Exception):
        pass

    def crash(model, shards):
        raise Crash

    with pytest.raises(Crash):
        T.fine_tune(build(), feats, cfg, evaluate=crash, main_metric="score", output_dir=tmp_path / "b")
    latest = training.latest_checkpoint(tmp_path / "b")
    blob = training.load_checkpoint(latest.path)
    assert latest.step == 3 and all(isinstance(g["lr"], float) for g in blob["optimizer"]["param_groups"])
    resumed = T.fine_tune(build(), feats, cfg, output_dir=tmp_path / "b", resume=True)
    for (k, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=k)
    # and an eager run resumes a graph run's checkpoint (one format)
    with pytest.raises(Crash):
        T.fine_tune(build(), feats, cfg, evaluate=crash, main_metric="score", output_dir=tmp_path / "c")
    eager_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_graphs=False))
    T.fine_tune(build(), feats, eager_cfg, output_dir=tmp_path / "c", resume=True)


@cuda
def test_shapes_past_the_graph_budget_run_eagerly(tmp_path, monkeypatch):
    build, feats = _setup(tmp_path, dropout=0.1)
    for i, f in enumerate(feats):  # lengths 5 to 68: batches of many padded widths
        n = 3 + 9 * (i % 8)
        f["input_ids"] = np.concatenate([[101], np.arange(1000, 1000 + n), [102]])
        f["token_type_ids"] = np.zeros(n + 2, dtype=np.int8)
    eager, eager_losses = _run(build, feats, cuda_graphs=False, group_by_length=True)
    made = []
    real_init = G.StepGraphs.__init__

    def small_budget(self, *a, **kw):
        real_init(self, *a, **{**kw, "max_graphs": 2})
        made.append(self)

    monkeypatch.setattr(G.StepGraphs, "__init__", small_budget)
    mixed, mixed_losses = _run(build, feats, cuda_graphs=True, group_by_length=True)
    assert len(made[0].graphs) == 2 and made[0].eager_shapes > 0
    torch.testing.assert_close(torch.tensor(mixed_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(eager.model.state_dict().items(), mixed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


@cuda
def test_rare_shapes_train_eagerly_as_the_captured_ones_would(tmp_path):
    """A rare padded length pads up to a common one (``batching.common_lengths``); shapes the run still
    has fewer than ``graph_min_steps`` steps of (each epoch's smaller last batch) are not captured. The
    run is still the eager run, unpadded, step for step. (Without dropout: a batch padded further draws
    its dropout masks over a longer tensor, so its real tokens get other masks.)"""
    build, feats = _setup(tmp_path, dropout=0.0)
    feats = feats[:37]  # 2 epochs of 5 steps: 4 batches of 8 and one of 5 each; lengths 24 and 32
    eager, eager_losses = _run(build, feats, cuda_graphs=False)
    made = []
    real_init = G.StepGraphs.__init__

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G.StepGraphs, "__init__", keep)
        mixed, mixed_losses = _run(build, feats, cuda_graphs=True, graph_min_steps=3)
    assert made[0].rare_steps == 2 and len(made[0].graphs) == 1  # 8 rows of 32 tokens; 5 rows, eagerly
    torch.testing.assert_close(torch.tensor(mixed_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(eager.model.state_dict().items(), mixed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)


# ----------------------------------------------------------------------------- CPU: the choice

def test_no_memory_to_capture_is_one_clear_error_naming_the_way_out(monkeypatch):
    """A capture that runs out of GPU memory (it briefly holds about 4x the weights) says what to do,
    instead of a CUDA traceback; the shape is not recorded as captured."""
    graphs = object.__new__(G.StepGraphs)  # the bookkeeping only: capture itself needs a GPU
    graphs.graphs, graphs.max_graphs, graphs.eager_shapes = {}, 4, 0

    def no_memory(micro):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(graphs, "_capture", no_memory)
    with pytest.raises(BertctlError, match="--no-cuda-graphs or a smaller --micro-batch-size; --resume"):
        graphs.step([{"input_ids": torch.zeros(2, 8, dtype=torch.long)}])
    assert graphs.graphs == {}


def test_where_graphs_do_not_apply():
    from bertctl.runtime import graphs_unsupported

    ok = dict(device_type="cuda", precision="bf16", optimizer="adamw", compile=False)
    assert graphs_unsupported(**ok) is None
    for change, words in [({"device_type": "cpu"}, "CUDA"), ({"precision": "fp16"}, "fp16"), ({"optimizer": "lamb"}, "AdamW"),
                          ({"compile": True}, "--compile")]:
        assert words in graphs_unsupported(**{**ok, **change})


def test_auto_is_off_on_the_cpu_and_asking_there_is_one_clear_error():
    assert not T.runtime_of(FinetuneConfig.of(device="cpu")).cuda_graphs
    assert not T.runtime_of(FinetuneConfig.of(device="cpu", cuda_graphs=False)).cuda_graphs
    with pytest.raises(BertctlError, match="--cuda-graphs: they need a CUDA device"):
        T.runtime_of(FinetuneConfig.of(device="cpu", cuda_graphs=True))


def test_attention_auto_is_padded_under_graphs():
    from bertctl.runtime import resolve_attention

    assert resolve_attention("auto", "cuda") == "unpadded"
    assert resolve_attention("auto", "cuda", graphs=True) == "sdpa"
    assert resolve_attention("unpadded", "cuda", graphs=True) == "unpadded"  # an explicit choice stays


def test_checkpoints_hold_float_learning_rates():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.param_groups[0]["lr"] = torch.tensor(2e-4)
    opt.param_groups[0]["initial_lr"] = torch.tensor(1e-3)
    sd = _plain_lr(opt.state_dict())
    assert sd["param_groups"][0]["lr"] == pytest.approx(2e-4) and isinstance(sd["param_groups"][0]["lr"], float)
    assert isinstance(sd["param_groups"][0]["initial_lr"], float)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # the live optimizer keeps its tensor


def test_optimizer_state_from_one_step_mode_loads_into_the_other():
    """An eager run's AdamW state (``capturable`` False) continued under graphs, by ``--resume`` or
    ``--keep-optimizer``, must stay capturable, or the capture fails; and the other way round. The
    fused or foreach step is the live optimizer's too."""
    def adamw(capturable):
        p = torch.nn.Parameter(torch.ones(3))
        impl = {"foreach": True} if capturable else {"fused": True}
        return p, torch.optim.AdamW([p], lr=1e-3, capturable=capturable, **impl)

    for saved_mode in (False, True):
        p, opt = adamw(saved_mode)
        p.grad = torch.full((3,), 0.5)
        if not saved_mode:
            opt.step()
        else:  # a capturable step needs a GPU: the state it leaves, written by hand
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.full((3,), 0.05),
                            "exp_avg_sq": torch.full((3,), 2.5e-4)}
        saved = _plain_lr(opt.state_dict())
        q, live = adamw(not saved_mode)
        load_optimizer_state(live, saved)
        group = live.param_groups[0]
        assert group["capturable"] is (not saved_mode)
        assert bool(group["fused"]) is saved_mode and bool(group["foreach"]) is (not saved_mode)
        assert torch.equal(live.state[q]["exp_avg"], opt.state[p]["exp_avg"])  # the moments come across
        assert float(live.state[q]["step"]) == 1.0


@cuda
def test_varied_shapes_leaves_cudnn_attention_as_it_found_it():
    from bertctl.nn.attention import varied_shapes

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with varied_shapes():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_every_rank_knows_every_ranks_shapes():
    """Several processes capture and replay together, so each step's graph key must be the same on every
    rank: every rank pads to the global batch's longest example, and the signature (that length, every
    rank's rows, the micro-batch size) fixes each rank's shapes."""
    from bertctl.data.batching import task_step

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, size=50)
    feats = [{"input_ids": np.ones(n, dtype=np.int64), "token_type_ids": np.zeros(n, dtype=np.int64), "labels": 1}
             for n in lengths]
    for idx, micro in ((np.arange(11), None), (rng.permutation(50)[:13], 3), (np.arange(7), 2)):
        steps = [task_step(feats, idx, rank=r, world_size=3, micro_batch_size=micro) for r in range(3)]
        assert len({sb.signature for sb in steps}) == 1
        longest = -(-lengths[idx].max() // 8) * 8
        for sb, part in zip(steps, np.array_split(idx, 3)):
            assert sb.signature[0] == longest
            assert {m["input_ids"].shape[1] for m in sb.micro} == {longest}
            assert [m["input_ids"].shape[0] for m in sb.micro] == [len(part[i:i + (micro or len(part))])
                                                                   for i in range(0, len(part), micro or len(part))]
            for m, rows in zip(sb.micro, (part[i:i + (micro or len(part))] for i in range(0, len(part), micro or len(part)))):
                assert m["attention_mask"].sum(dim=1).tolist() == lengths[rows].tolist()  # padding stays masked
    one = task_step(feats, np.arange(11), rank=0, world_size=1, micro_batch_size=None)
    assert one.signature == () and one.micro[0]["input_ids"].shape[1] == -(-lengths[:11].max() // 8) * 8


def test_one_flat_buffer_holds_every_gradient_and_backward_fills_it():
    from bertctl.train import distributed

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    flat = distributed.flat_gradients(model)
    assert flat.numel() == sum(p.numel() for p in model.parameters()) and not flat.any()
    model(torch.randn(5, 4)).square().sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert flat.any() and torch.equal(flat, grads)  # accumulated in place: the views still point into it
    flat.mul_(0.5)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), grads * 0.5)
    with pytest.raises(ValueError, match="one parameter dtype"):
        distributed.flat_gradients(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double()))


def _broadcast_case(rank: int, out: str) -> None:
    from bertctl.train import distributed

    torch.manual_seed(rank)  # each rank draws other weights, as separate processes do
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.add_(rank + 1.0)
    distributed.broadcast_parameters(model, distributed.Dist(rank=rank, world_size=2))
    torch.save(model.state_dict(), f"{out}/broadcast-rank{rank}.pt")


class _Tiny(torch.nn.Module):
    """Word embeddings, two layers, a head and a layer no loss uses (as a pooler in NER)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(50, 6, padding_idx=0)
        self.one, self.two = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.unused = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 50, bias=False)
        if tied:
            self.head.weight = self.word_embeddings.weight

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.two(torch.tanh(self.one(self.word_embeddings(ids))))
        return self.head(h).square().mean()


def _data(step: int, rank: int) -> list[torch.Tensor]:
    """Each rank's micro-batches: 3 rows on rank 0, 2 on rank 1, in two micro-batches, ids below 20."""
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = (2, 1) if rank == 0 else (1, 1)
    return [torch.randint(1, 20, (r, 5), generator=g) for r in rows]


#: The reducer's cases: (bucket_mb, tied, wire).
REDUCER_CASES = {"one-bucket": (25.0, False, "fp32"), "bucket-per-parameter": (1e-4, False, "fp32"),
                 "no-overlap": (0.0, False, "fp32"), "tied-embeddings": (1e-4, True, "fp32"),
                 "one-bucket-bf16": (25.0, False, "bf16"), "no-overlap-bf16": (0.0, False, "bf16"),
                 "tied-embeddings-bf16": (1e-4, True, "bf16")}


def _reducer_case(rank: int, out: str, name: str, bucket_mb: float, tied: bool, wire: str) -> None:
    from bertctl.train import distributed

    torch.manual_seed(0)
    model = _Tiny(tied)
    flat = distributed.flat_gradients(model)
    reducer = distributed.GradientReducer(model, flat, distributed.Dist(rank=rank, world_size=2), bucket_mb=bucket_mb,
                                          reduce_dtype=distributed.REDUCE_DTYPES[wire])
    grads, launched = [], []
    for step in range(3):  # the first step learns which parameters get no gradient; later ones rely on it
        micro = _data(step, rank)
        every_ids = torch.cat([t.reshape(-1) for r in (0, 1) for t in _data(step, r)])  # known to every rank
        for i, ids in enumerate(micro):
            if i == len(micro) - 1:
                reducer.arm()
            model.loss(ids).backward()
        launched.append(len(reducer.buckets) and len(reducer._works))  # by backward's hooks
        reducer.finish(every_ids)
        grads.append(flat.clone())
        flat.zero_()
    torch.save({"grads": grads, "rows": reducer.rows is not None, "buckets": len(reducer.buckets), "launched": launched},
               f"{out}/{name}-rank{rank}.pt")


def _gloo_worker(rank: int, out: str) -> None:
    """Every case in one pair of processes (two fresh interpreters cost more than all the cases), each case in a
    process group of its own."""
    import torch.distributed as tdist

    cases = [("broadcast", lambda: _broadcast_case(rank, out))] + [
        (name, lambda name=name, case=case: _reducer_case(rank, out, name, *case)) for name, case in REDUCER_CASES.items()]
    for name, run in cases:
        tdist.init_process_group("gloo", init_method=f"file://{out}/init-{name}", rank=rank, world_size=2)
        run()
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """The cases' results from two gloo processes, by case and rank; a case a process failed at (and the cases
    after it) hold the error."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("gloo")
    try:
        mp.spawn(_gloo_worker, args=(str(out),), nprocs=2)
        error = None
    except Exception as e:  # the failing process's traceback
        error = e
    results = {}
    for name in ["broadcast", *REDUCER_CASES]:
        files = [out / f"{name}-rank{r}.pt" for r in (0, 1)]
        results[name] = [torch.load(f) for f in files] if all(f.exists() for f in files) else error
    return results


def _gloo_result(results: dict, name: str) -> list:
    got = results[name]
    if isinstance(got, BaseException) or got is None:
        pytest.fail(f"the gloo processes failed at or before the case {name}: {got}")
    return got


def test_parameters_and_buffers_start_as_rank_zeros(gloo_results):
    """Without DDP (graphs under torchrun), rank 0's weights and buffers reach every rank, as DDP's wrap does."""
    zero, one = _gloo_result(gloo_results, "broadcast")
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).state_dict()
    expected["1.running_mean"] += 1.0
    for k in expected:
        assert torch.equal(zero[k], expected[k]) and torch.equal(one[k], expected[k]), k


@pytest.mark.parametrize("name", list(REDUCER_CASES))
def test_the_reducer_averages_gradients_over_ranks(gloo_results, name):
    """Buckets started by backward hooks, the embedding's touched rows alone, accumulation, a parameter
    without gradient: every rank ends with the sum of the ranks' gradients (2 gloo processes; the
    engine's loss scales make it the mean). Sent in bf16, each rank's gradient is rounded to bf16 once
    and their sum once."""
    from bertctl.train import distributed

    bucket_mb, tied, wire = REDUCER_CASES[name]
    got = _gloo_result(gloo_results, name)
    torch.manual_seed(0)
    model = _Tiny(tied)
    flat = distributed.flat_gradients(model)
    for step in range(3):
        local = []
        for rank in (0, 1):
            for ids in _data(step, rank):
                model.loss(ids).backward()
            local.append(flat.clone())
            flat.zero_()
        if wire == "bf16":
            expected = (local[0].bfloat16() + local[1].bfloat16()).float()
            assert not torch.equal(expected, local[0] + local[1])  # the rounding is there to see
        else:
            expected = local[0] + local[1]
        for rank in (0, 1):
            torch.testing.assert_close(got[rank]["grads"][step], expected, rtol=1e-5, atol=1e-7)
    emb = model.word_embeddings.weight.numel()
    if not tied:  # untied, the rows no id touched stay zero
        assert torch.equal(got[0]["grads"][0][:emb][20 * 6:], torch.zeros(30 * 6))
    assert got[0]["rows"] == (bucket_mb > 0 and not tied)
    assert got[0]["buckets"] == {25.0: 1, 1e-4: 7, 0.0: 0}[bucket_mb]  # tied: the embedding is in a bucket
    # the first step waits at the unused layer's buckets (after the head's, untied); from then on
    # backward starts every bucket
    assert got[0]["launched"] == {25.0: [0, 1, 1], 1e-4: [0 if tied else 1, 7, 7], 0.0: [0, 0, 0]}[bucket_mb]


def test_the_reducer_says_so_when_a_parameter_unused_at_first_gets_a_gradient(tmp_path):
    import torch.distributed as tdist

    from bertctl.train import distributed

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        model = _Tiny()
        flat = distributed.flat_gradients(model)
        reducer = distributed.GradientReducer(model, flat, distributed.Dist(rank=0, world_size=1), bucket_mb=1e-4)
        ids = torch.tensor([[1, 2, 3]])
        reducer.arm()
        model.loss(ids).backward()
        reducer.finish(ids.reshape(-1))
        reducer.arm()
        with pytest.raises(RuntimeError, match="same parameters"):
            (model.loss(ids) + model.unused(model.word_embeddings(ids)).sum()).backward()
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("world_size,micro", [(1, None), (1, 3), (3, None), (3, 2)])
def test_each_step_knows_how_many_steps_of_the_run_share_its_shapes(world_size, micro):
    """``shape_steps``, planned before the run from the batch order alone, is the number of steps from the
    start step to the end whose graph key (every micro-batch's tensor shapes, and the signature) equals this
    step's, on every rank alike: the ranks then capture, or run eagerly, at the same steps."""
    import collections
    import itertools

    from bertctl.data.batching import steps_per_epoch, task_batches

    rng = np.random.default_rng(1)
    feats = [{"input_ids": np.ones(n, dtype=np.int64), "token_type_ids": np.zeros(n, dtype=np.int64), "labels": 1}
             for n in rng.integers(3, 40, size=61)]
    per_epoch = steps_per_epoch(len(feats), 12, world_size)
    for start, end in ((0, 3 * per_epoch), (4, 2 * per_epoch + 1)):
        runs = []
        for rank in range(world_size):
            it = task_batches(feats, 12, seed=5, start_step=start, steps_per_epoch=per_epoch, group_by_length=False,
                              rank=rank, world_size=world_size, micro_batch_size=micro, max_steps=end)
            runs.append(list(itertools.islice(it, end - start)))
        for steps in runs:
            keys = [(G.StepGraphs.key(sb.micro), sb.signature) for sb in steps]
            seen = collections.Counter(keys)
            assert [sb.shape_steps for sb in steps] == [seen[k] for k in keys]
            assert len(seen) > 1
        assert len({tuple(sb.shape_steps for sb in steps) for steps in runs}) == 1
    unplanned = next(task_batches(feats, 12, seed=5, start_step=0, steps_per_epoch=per_epoch, group_by_length=False))
    assert unplanned.shape_steps is None


def test_the_finetune_flag_defaults_to_the_engines_threshold():
    from bertctl.cli.finetune import GRAPH_MIN_STEPS

    assert GRAPH_MIN_STEPS.default == MIN_SHAPE_STEPS == FinetuneConfig().train.graph_min_steps


@cuda
def test_long_steps_of_wide_heads_train_under_cudnn_attention_as_eagerly(monkeypatch):
    """Where the rule keeps cuDNN's attention for training (64-wide heads, long steps; its step count lowered
    here), the training steps see it on, and the graphs replay the eager steps (bf16, dropout 0.1)."""
    from bertctl.config import BertConfig
    from bertctl.model import BertForSequenceClassification
    from bertctl.nn.attention import cudnn_training_attention

    monkeypatch.setattr(T, "cudnn_training_attention", lambda h, n, steps: cudnn_training_attention(h, n, 10**6))
    seen = []
    sums = T.TaskObjective.sums

    def recording(self, model, mb):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sums(self, model, mb)
    monkeypatch.setattr(T.TaskObjective, "sums", recording)
    rng = np.random.default_rng(0)
    feats = [{"input_ids": rng.integers(5, 100, int(n)), "token_type_ids": np.zeros(int(n), dtype=np.int8),
              "labels": i % 2} for i, n in enumerate(rng.integers(270, 301, 32))]

    def build():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=256, num_labels=2))
    eager, eager_losses = _run(build, feats, precision="bf16", cuda_graphs=False)
    graphed, graph_losses = _run(build, feats, precision="bf16", cuda_graphs=True)
    assert seen and all(seen)
    assert len(graph_losses) == len(eager_losses) == 8
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (k, a), b in zip(eager.model.state_dict().items(), graphed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
