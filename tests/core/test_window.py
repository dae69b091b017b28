"""State poisoned by a sample, traced to the sample: the window since a healthy snapshot replayed from it."""
import math

import torch
from torch import nn

from petr_stability.core.diagnosis.sandbox import capture_rng
from petr_stability.core.diagnosis.window import poisoned_state, trace_incident, trace_window

HUGE = 1e20  # finite in fp32; its square is not, so a batch's variance overflows and running_var turns Inf
ROWS = 4


class Net(nn.Module):
    """Linear -> BatchNorm over tokens (the PETR test model's backbone shape) -> a dropout -> a head."""

    def __init__(self, tokens: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = tokens
        self.proj = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.proj(x)
        y = self.norm(y.reshape(-1, 8)).reshape(y.shape) if self.tokens else self.norm(y)
        return {"loss": self.head(self.drop(y)).pow(2).mean()}


class Memory(nn.Module):
    """A StreamPETR-style memory kept as a plain attribute, reset by ``reset_memory()``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(6, 8)
        self.memory = torch.zeros(8)

    def reset_memory(self) -> None:
        self.memory = torch.zeros(8)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.proj(x)
        self.memory = 0.9 * self.memory + 0.1 * y.detach().pow(2).mean(dim=tuple(range(y.dim() - 1)))
        return {"loss": y.pow(2).mean()}


def dataset(n: int = 24, bad=(), tokens: int = 5, varied: bool = False):
    """``n`` samples; those in ``bad`` hold HUGE everywhere (alone, such a sample has no variance to overflow: only
    with ordinary samples does it poison BatchNorm), or with ``varied`` HUGE times random values."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(tokens, 6, generator=g) if tokens else torch.randn(6, generator=g) for _ in range(n)]
    for i in bad:
        data[i] = data[i] * HUGE if varied else torch.full_like(data[i], HUGE)
    return data


def setup(bad=(), model=None, tokens: int = 5, n: int = 24, varied: bool = False):
    model = model if model is not None else Net()
    data = dataset(n, bad, tokens, varied)
    fetched = []

    def rebuild(indices):
        fetched.extend(indices)
        return torch.stack([data[i] for i in indices])

    def forward_for(batch):
        return lambda: model(batch)

    window = [(10 + k, list(range(k * ROWS, (k + 1) * ROWS))) for k in range(n // ROWS)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return model, state, window, rebuild, forward_for, fetched


def copies(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            [m.training for m in model.modules()])


def same(model, saved):
    state, grads, modes = saved
    now = model.state_dict()
    assert set(now) == set(state) and all(torch.equal(now[k], state[k]) for k in state)
    for n, p in model.named_parameters():
        assert (p.grad is None and grads[n] is None) or torch.equal(p.grad, grads[n]), n
    assert [m.training for m in model.modules()] == modes


def test_the_sample_that_makes_running_var_inf_is_found_and_only_it_is_blamed():
    model, state, window, rebuild, forward_for, _ = setup(bad=[13])
    report = trace_window(model, state, window, rebuild, forward_for)
    assert report["found"] and not report["ambiguous"]
    assert report["iteration"] == 13 and report["position"] == 3 and report["indices"] == [12, 13, 14, 15]
    assert report["rows"] == [1] and report["blamed"] == [13]
    assert "norm.running_var" in report["poisoned"]
    assert report["replayed"] == [window[k][1] for k in range(4)]  # it stops at the culprit
    # Each row re-run with the last batch replayed clean (checked clean from the same state first).
    assert report["reference"] == [8, 9, 10, 11]
    assert [e["poisons"] for e in report["row_evidence"]] == [False, True, False, False]
    # The window up to the culprit, the reference, each row, the rest of the batch.
    assert report["seconds"] >= 0 and report["forwards"] == 4 + 1 + ROWS + 1


def test_a_sample_poisoning_alone_is_found_at_the_window_start_with_the_next_batch_as_reference():
    model, state, window, rebuild, forward_for, _ = setup(bad=[2], varied=True)
    report = trace_window(model, state, window, rebuild, forward_for)
    assert report["found"] and report["position"] == 0 and report["blamed"] == [2]
    assert report["reference"] == [4, 5, 6, 7]


def test_two_bad_samples_of_one_batch_are_both_blamed_and_no_good_one():
    model, state, window, rebuild, forward_for, _ = setup(bad=[17, 19])
    report = trace_window(model, state, window, rebuild, forward_for)
    assert report["found"] and report["blamed"] == [17, 19] and not report["ambiguous"]


def test_the_model_state_and_the_rng_are_restored_bit_exactly():
    model, _, window, rebuild, forward_for, _ = setup(bad=[13])
    model(torch.randn(3, 5, 6))["loss"].backward()  # live gradients and moved statistics
    # The healthy snapshot differs from the live state (other weights and statistics).
    state = {k: (v + 0.5 if v.is_floating_point() else v).clone() for k, v in model.state_dict().items()}
    model.eval()
    model.drop.train()
    saved, rng = copies(model), capture_rng()
    report = trace_window(model, state, window, rebuild, forward_for)
    assert report["found"]
    same(model, saved)
    assert torch.equal(torch.get_rng_state(), rng["cpu"])


def test_a_window_without_poisoning_returns_nothing():
    model, state, window, rebuild, forward_for, _ = setup()
    saved = copies(model)
    report = trace_window(model, state, window, rebuild, forward_for)
    assert not report["found"] and "no batch of the window" in report["why"]
    assert len(report["replayed"]) == len(window) and "blamed" not in report
    same(model, saved)


def test_unknown_batches_are_skipped_and_counted():
    model, state, window, rebuild, forward_for, _ = setup(bad=[13])
    window[1] = (window[1][0], None)
    report = trace_window(model, state, window, rebuild, forward_for)
    assert report["found"] and report["blamed"] == [13] and report["unknown_batches"] == 1


def test_a_sample_that_cannot_be_rerun_alone_makes_the_narrowing_ambiguous():
    # BatchNorm over (batch, channels) refuses a batch of one in train mode, and a window of one batch offers no
    # samples known to be clean to re-run a row with: no row can be cleared, so the whole batch comes back, flagged.
    model, state, window, rebuild, forward_for, _ = setup(bad=[13], model=Net(tokens=False), tokens=0)
    report = trace_window(model, state, window[3:4], rebuild, forward_for)
    assert report["found"] and report["ambiguous"] and report["rows"] == [0, 1, 2, 3]
    assert report["blamed"] == [12, 13, 14, 15] and "alone" in report["why"]
    assert all(e["poisons"] is None and "ValueError" in e["error"] for e in report["row_evidence"])


def test_every_batch_poisoning_the_state_is_not_one_sample():
    model, state, window, rebuild, forward_for, _ = setup(bad=range(24), varied=True)
    report = trace_window(model, state, window, rebuild, forward_for)
    assert not report["found"] and report["every_batch"] and report["rows"] == [] and report["blamed"] == []


def test_a_plain_attribute_memory_is_traced_too_and_put_back():
    model = Memory()
    model, state, window, rebuild, forward_for, _ = setup(bad=[6], model=model)
    live = model.memory = torch.full((8,), math.nan)  # the live memory is poisoned
    resets = []
    report = trace_window(model, state, window, rebuild, forward_for,
                          reset=lambda m: resets.append(m.reset_memory()))
    assert resets and report["found"] and report["blamed"] == [6] and report["poisoned"] == ["memory"]
    assert model.memory is live and bool(model.memory.isnan().all())


def test_trace_incident_applies_only_to_poisoned_buffers_with_finite_weights():
    model, state, window, rebuild, forward_for, _ = setup(bad=[13])

    class Loader:
        dataset = dataset(24, [13])

        @staticmethod
        def collate_fn(samples):
            return torch.stack(samples)

    assert trace_incident(model, Loader(), state, 9, window, forward_for) is None  # nothing poisoned
    model.norm.running_var.fill_(math.inf)
    assert poisoned_state(model) == ["norm.running_var"]
    report = trace_incident(model, Loader(), state, 11, window, forward_for)
    assert report["found"] and report["blamed"] == [13] and report["window"] == [12, 15]
    assert report["live_poisoned"] == ["norm.running_var"] and report["since"] == 11
    assert trace_incident(model, Loader(), None, 11, window, forward_for) is None  # no snapshot state
    with torch.no_grad():
        model.proj.weight[0, 0] = math.nan
    assert trace_incident(model, Loader(), state, 11, window, forward_for) is None  # poisoned weights: not this


def test_a_found_window_is_classed_data_naming_the_batch_and_the_buffer():
    from petr_stability.core.causes import Cause
    from petr_stability.core.diagnosis import classify
    from petr_stability.core.diagnosis.window import window_samples

    model, state, window, rebuild, forward_for, _ = setup(bad=[13])
    model.norm.running_var.fill_(math.inf)

    class Loader:
        dataset = dataset(24, [13])
        collate_fn = staticmethod(torch.stack)

    trace = trace_incident(model, Loader(), state, 11, window, forward_for)
    report = {"reproduced": False, "first": None, "window": trace}
    c = classify(report)
    assert c.cause == Cause.DATA and c.signals["window"]["blamed"] == [13]
    assert "norm.running_var" in c.evidence and "the batch of iter 13" in c.evidence and "[13]" in c.evidence
    assert window_samples(report) == [{"index": 13}]
    from petr_stability.core.diagnosis import summarize

    assert "the batch of iter 13 is the first to poison norm.running_var: dataset indices [13]" in summarize(report)
    assert classify({"reproduced": False, "first": None, "window": dict(trace, found=False)}).cause == Cause.UNKNOWN
    assert window_samples({"window": dict(trace, found=False)}) == []
