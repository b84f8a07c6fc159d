"""The lecture panels of qkv lab (qkv.lab.panels): their numbers against references computed here
by hand or with plain torch (eq. 1, the softmax's Jacobian, the sinusoid formula of section 3.5,
mask grids written out, Table 1), their routes on a bare FastAPI app, the 422s, and the fragment."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from qkv.lab import panels
from qkv.lab.panels import PanelError


# --- attention -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("d_k", [4, 64, 1024])
def test_attention_weights_are_the_softmax_of_the_hand_scaled_scores(d_k):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, d_k, generator=g, dtype=torch.float64), torch.randn(9, d_k, generator=g, dtype=torch.float64)
    torch.testing.assert_close(panels.attention_weights(q, k, scaled=True), torch.softmax(q @ k.T / d_k**0.5, dim=-1))
    torch.testing.assert_close(panels.attention_weights(q, k, scaled=False), torch.softmax(q @ k.T, dim=-1))


def test_jacobian_norm_is_that_of_diag_p_minus_p_pT():
    scores = torch.tensor([[0.3, -1.2, 2.0, 0.0], [5.0, 0.0, 0.0, 0.0], [40.0, 0.0, 1.0, 2.0]], dtype=torch.float64)
    expected = []
    for s in scores:
        p = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
        expected.append((torch.diag(p) - torch.outer(p, p)).norm())  # ∂softmax_i/∂s_j = p_i (δ_ij - p_j)
    torch.testing.assert_close(panels.softmax_jacobian_norms(scores), torch.stack(expected))


def test_entropy_in_nats():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(panels.entropy(p), torch.tensor([math.log(2), 0.0, math.log(3)], dtype=torch.float64))


def test_attention_panel_numbers_from_the_seeded_sample():
    a = panels.attention_panel(d_k=32, n_keys=12, seed=7)
    g = torch.Generator().manual_seed(7)  # the documented draw: the query, then the keys, N(0, 1), float64
    q, k = torch.randn(1, 32, generator=g, dtype=torch.float64), torch.randn(12, 32, generator=g, dtype=torch.float64)
    raw = (q @ k.T)[0]
    torch.testing.assert_close(torch.tensor(a["unscaled"]["scores"], dtype=torch.float64), raw)
    torch.testing.assert_close(torch.tensor(a["scaled"]["scores"], dtype=torch.float64), raw / math.sqrt(32))
    for name, s in (("scaled", raw / math.sqrt(32)), ("unscaled", raw)):
        p = torch.softmax(s, dim=-1)
        torch.testing.assert_close(torch.tensor(a[name]["weights"], dtype=torch.float64), p)
        assert a[name]["max_weight"] == pytest.approx(p.max().item())
        assert a[name]["entropy"] == pytest.approx(-(p * p.log()).sum().item())
        assert a[name]["grad_norm"] == pytest.approx((torch.diag(p) - torch.outer(p, p)).norm().item())
    assert a["uniform_entropy"] == pytest.approx(math.log(12))


def test_without_scaling_the_softmax_peaks_and_its_gradient_vanishes_as_d_k_grows():
    sweep = panels.attention_panel(d_k=1024)["sweep"]
    assert [s["d_k"] for s in sweep] == [4, 16, 64, 256, 1024]
    unscaled = [s["unscaled"] for s in sweep]
    scaled = [s["scaled"] for s in sweep]
    assert all(a["grad_norm"] > b["grad_norm"] for a, b in zip(unscaled[1:], unscaled[2:]))
    assert all(a["max_weight"] < b["max_weight"] for a, b in zip(unscaled, unscaled[1:]))
    assert unscaled[-1]["max_weight"] > 0.95 and unscaled[-1]["grad_norm"] < 0.1 * scaled[-1]["grad_norm"]
    # with 1/√d_k the logits have variance 1 whatever d_k: the statistics stay put
    assert max(s["grad_norm"] for s in scaled) < 1.5 * min(s["grad_norm"] for s in scaled)


@pytest.mark.parametrize("kwargs, field", [({"d_k": 0}, "d_k"), ({"d_k": 1025}, "d_k"), ({"n_keys": 1}, "n_keys"),
                                           ({"n_keys": 33}, "n_keys"), ({"seed": -1}, "seed"), ({"d_k": 2.5}, "d_k")])
def test_attention_bounds(kwargs, field):
    with pytest.raises(PanelError, match=f"^{field}: "):
        panels.attention_panel(**kwargs)


# --- positional encoding -------------------------------------------------------------------------------

def test_positions_follow_the_sinusoid_formula_and_depend_on_the_offset():
    length, d = 30, 16
    p = panels.positions_panel(length, d)
    for pos in (0, 1, 7, 29):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)  # PE(pos, 2i) = sin, PE(pos, 2i+1) = cos (section 3.5)
            assert p["encoding"][pos][2 * i] == pytest.approx(math.sin(angle), abs=1e-4)
            assert p["encoding"][pos][2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-4)
    # PE(i)·PE(j) = Σ_i sin a sin b + cos a cos b = Σ_i cos((i - j)·ω_i): a function of the offset only
    for k in (0, 1, 5, 29):
        expected = sum(math.cos(k / 10000 ** (2 * i / d)) for i in range(d // 2))
        assert p["by_offset"][k] == pytest.approx(expected, abs=1e-4)
        assert all(p["dots"][i][i + k] == pytest.approx(expected, abs=1e-3) for i in range(length - k))
    assert p["dots"][0][0] == pytest.approx(d / 2, abs=1e-3)
    assert p["offset_spread"] < 1e-4


@pytest.mark.parametrize("kwargs, field", [({"d_model": 7}, "d_model"), ({"d_model": 514}, "d_model"),
                                           ({"length": 0}, "length"), ({"length": 201}, "length")])
def test_positions_bounds(kwargs, field):
    with pytest.raises(PanelError, match=f"^{field}: "):
        panels.positions_panel(**kwargs)


# --- masks ---------------------------------------------------------------------------------------------

def test_mask_grids_of_a_hand_written_batch():
    m = panels.masks_panel("a b c\n  \nd e")  # the blank line is no sentence
    assert m["tokens"] == [["a", "b", "c"], ["d", "e", "<pad>"]]
    assert m["ids"][1][2] == 0 and len({*m["ids"][0], *m["ids"][1][:2]}) == 5  # PAD = 0, one id per word
    T, F = True, False
    assert m["padding"] == [[T, T, T], [T, T, F]]
    assert m["causal"] == [[T, F, F], [T, T, F], [T, T, T]]
    assert m["decoder"] == [[[T, F, F], [T, T, F], [T, T, T]],
                            [[T, F, F], [T, T, F], [T, T, F]]]  # the pad's own row no longer sees itself
    assert m["differs_from_causal"] == [[], [2]]


@pytest.mark.parametrize("text, why", [("", "1 to 3 sentences"), ("a\nb\nc\nd", "1 to 3 sentences"),
                                       (" ".join(["w"] * 33), "sentence 1 has 33 words"), ("x" * 601, "at most 600")])
def test_masks_text_bounds(text, why):
    with pytest.raises(PanelError, match=f"^text: .*{why}"):
        panels.masks_panel(text)


# --- cost: Table 1 and the benchmark results -----------------------------------------------------------

def test_table1_rows_and_path_lengths():
    rows = {r["layer"]: r for r in panels.table1(n=512, r=64, k=3)}
    paper = {"self-attention": ("O(n²·d)", "O(1)", "O(1)"), "lstm": ("O(n·d²)", "O(n)", "O(n)"),  # Table 1
             "conv": ("O(k·n·d²)", "O(1)", "O(n/k)"), "restricted": ("O(r·n·d)", "O(1)", "O(n/r)")}
    for name, row in paper.items():
        assert (rows[name]["complexity"], rows[name]["sequential"], rows[name]["path"]) == row
    # the exact path lengths at n = 512: 1, n - 1, ⌈(n-1)/(k-1)⌉, ⌈(n-1)/r⌉, ⌈log_3 512⌉ (3^5 < 512 <= 3^6)
    got = {name: rows[name]["path_at_n"] for name in ("self-attention", "lstm", "conv", "restricted", "conv-dilated")}
    assert got == {"self-attention": 1, "lstm": 511, "conv": 256, "restricted": 8, "conv-dilated": 6}


def test_cost_panel_reads_the_shipped_results():
    c = panels.cost_panel()
    assert c["layers"]["file"].startswith("complexity-") and c["layers"]["file"] in c["files"]["layers"]
    ex = c["layers"]["exponents"]
    assert ex["attention-core"]["flops"] == pytest.approx(2.0, abs=0.05)  # O(n²·d)
    assert ex["lstm"]["flops"] == pytest.approx(1.0, abs=0.05)  # O(n·d²)
    assert ex["lstm"]["sequential_steps"] == pytest.approx(1.0, abs=0.05)  # O(n)
    assert c["table1_n"] == c["layers"]["settings"]["ns"][-1]
    lr = c["long_range"]
    assert set(lr["accuracy"]) == {"rnn", "lstm", "transformer"} and lr["chance"] == 1 / lr["settings"]["symbols"]
    data = json.loads((panels.RESULTS_DIR / lr["file"]).read_text())
    runs = [[r["t"], r["accuracy"]] for r in data["runs"] if r["model"] == "transformer"]
    assert lr["accuracy"]["transformer"] == runs


def _long_range(models, distances, started):
    return {"settings": {"models": models, "symbols": 4, "steps": 1, "batch": 1, "hidden": 4, "distances": distances},
            "machine": {"started": started},
            "runs": [{"model": m, "t": t, "accuracy": 0.5} for t in distances for m in models]}


def test_cost_panel_picks_the_most_complete_result_newest_first(tmp_path):
    every = ["rnn", "lstm", "transformer"]
    write = lambda name, *args: (tmp_path / name).write_text(json.dumps(_long_range(*args)))  # noqa: E731
    write("long-range-a.json", every, [2], "2026-01-01T00:00:00+00:00")
    write("long-range-b.json", every, [2], "2026-01-02T00:00:00+00:00")
    write("long-range-c.json", ["transformer"], [2, 5], "2026-01-03T00:00:00+00:00")  # a partial rerun
    (tmp_path / "long-range-broken.json").write_text("{")
    c = panels.cost_panel(tmp_path)
    assert c["long_range"]["file"] == "long-range-b.json"
    assert c["files"]["long_range"] == ["long-range-a.json", "long-range-b.json", "long-range-c.json"]
    write("long-range-full-2025-12-31T0000Z.json", every, [2, 5], None)  # older, more points; its date from its name
    c = panels.cost_panel(tmp_path)
    assert c["long_range"]["file"] == "long-range-full-2025-12-31T0000Z.json"
    assert c["files"]["long_range"][0] == "long-range-full-2025-12-31T0000Z.json"
    assert panels.cost_panel(tmp_path, long_range_file="long-range-c.json")["long_range"]["accuracy"] == \
        {"transformer": [[2, 0.5], [5, 0.5]]}
    assert c["layers"] is None and c["layers_note"] == "no results yet: run `qkv bench layers`"
    with pytest.raises(PanelError, match="^file: no result file 'nope.json'"):
        panels.cost_panel(tmp_path, long_range_file="nope.json")


def test_cost_panel_without_results(tmp_path):
    c = panels.cost_panel(tmp_path / "missing")
    assert c["layers"] is None and c["long_range"] is None
    assert c["long_range_note"] == "no results yet: run `qkv bench long-range`"
    assert len(c["table1"]) == 8


def test_measure_counts_eq1_flops():
    m = panels.measure_panel(d=16, n_max=32, layers="attention-core")
    points = m["layers"]["layers"]["attention-core"]
    assert [p["n"] for p in points] == [16, 32]
    assert [p["flops_forward"] for p in points] == [4 * n * n * 16 for n in (16, 32)]  # QKᵀ and AV: 4·n²·d
    assert [p["path_length"] for p in points] == [1, 1]


@pytest.mark.parametrize("kwargs, field", [({"d": 12}, "d"), ({"d": 256}, "d"), ({"n_max": 512}, "n_max"),
                                           ({"layers": "lstm,bogus"}, "layers"), ({"layers": ""}, "layers")])
def test_measure_bounds(kwargs, field):
    with pytest.raises(PanelError, match=f"^{field}: "):
        panels.measure_panel(**kwargs)


# --- the schedule and label smoothing --------------------------------------------------------------------

def test_schedule_is_the_papers_formula_for_every_pair():
    s = panels.schedule_panel("512, 64", "4000,400", steps=10000)
    assert [(c["d_model"], c["warmup"]) for c in s["curves"]] == [(512, 4000), (512, 400), (64, 4000), (64, 400)]
    for c in s["curves"]:
        d, w = c["d_model"], c["warmup"]
        assert len(c["steps"]) <= 301 and w in c["steps"] and c["steps"][0] == 1 and c["steps"][-1] == 10000
        for step, lr in zip(c["steps"], c["lr"]):  # section 5.3, written out
            assert lr == pytest.approx(d ** -0.5 * min(step ** -0.5, step * w ** -1.5), rel=1e-12)
        assert c["peak_lr"] == pytest.approx(1 / math.sqrt(d * w)) and max(c["lr"]) == pytest.approx(c["peak_lr"])
        assert c["steps"][c["lr"].index(max(c["lr"]))] == w
    src = s["source"]
    assert src["name"] == "qkv.training.schedule.noam" and src["file"] == "qkv/training/schedule.py"
    assert src["code"].startswith("def noam(") and "min(step**-0.5, step * warmup**-1.5)" in src["code"]
    from qkv.training import schedule

    lines = Path(schedule.__file__).read_text().splitlines()
    assert lines[src["line"] - 1].startswith("def noam(")


@pytest.mark.parametrize("kwargs, field", [({"d_model": "abc"}, "d_model"), ({"d_model": "1,2,3,4,5"}, "d_model"),
                                           ({"d_model": "4"}, "d_model"), ({"warmup": "0"}, "warmup"),
                                           ({"warmup": ""}, "warmup"), ({"steps": 5}, "steps")])
def test_schedule_bounds(kwargs, field):
    with pytest.raises(PanelError, match=f"^{field}: "):
        panels.schedule_panel(**kwargs)


@pytest.mark.parametrize("eps, vocab, gold", [(0.1, 10, 3), (0.0, 5, 0), (0.3, 37, 36)])
def test_smoothed_target_is_qkvs_convention(eps, vocab, gold):
    """qkv's loss smooths uniformly over all V tokens, gold included (section 5.4; torch's
    cross_entropy(label_smoothing=ε)): q = (1 − ε)·onehot + ε/V."""
    s = panels.smoothing_panel(eps, vocab, gold)
    want = [(1 - eps) * (k == gold) + eps / vocab for k in range(vocab)]
    assert s["target"] == pytest.approx(want, abs=1e-12) and sum(s["target"]) == pytest.approx(1.0)
    # the loss curve: cross-entropy against q, computed here; smallest where p(gold) = q(gold)
    for x, smoothed, plain_loss in zip(s["p_gold"], s["loss"]["smoothed"], s["loss"]["plain"]):
        p = [(1 - x) / (vocab - 1)] * vocab
        p[gold] = x
        assert smoothed == pytest.approx(-sum(q * math.log(pk) for q, pk in zip(want, p)), rel=1e-9)
        assert plain_loss == pytest.approx(-math.log(x), rel=1e-9)
        logits = torch.tensor([p], dtype=torch.float64).log()
        torch_loss = torch.nn.functional.cross_entropy(logits, torch.tensor([gold]), label_smoothing=eps)
        assert smoothed == pytest.approx(torch_loss.item(), rel=1e-9)
    # smallest at the point nearest q(gold) (0.01 apart, 0.01 to 0.99: ε = 0 has it at the last)
    assert s["best_p_gold"] == pytest.approx(min(max(want[gold], 0.01), 0.99), abs=0.006)
    assert s["source"]["name"] == "qkv.losses.label_smoothed_nll_loss"


@pytest.mark.parametrize("kwargs, field", [({"epsilon": 0.6}, "epsilon"), ({"epsilon": -0.1}, "epsilon"),
                                           ({"vocab": 1}, "vocab"), ({"vocab": 65}, "vocab"), ({"gold": 10}, "gold")])
def test_smoothing_bounds(kwargs, field):
    with pytest.raises(PanelError, match=f"^{field}: "):
        panels.smoothing_panel(**kwargs)


# --- the routes ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("fastapi", reason='the lab needs fastapi: pip install -c constraints.txt -e ".[serve]"')
    pytest.importorskip("httpx", reason='the route tests need httpx: pip install -c constraints.txt -e ".[serve]"')
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    panels.register(app, results_dir=tmp_path_factory.mktemp("no-results"))
    with TestClient(app) as c:
        yield c


def test_routes_answer_what_the_functions_compute(client):
    r = client.get("/api/panels/attention", params={"d_k": 16, "n_keys": 5, "seed": 2})
    assert r.status_code == 200 and r.json() == json.loads(json.dumps(panels.attention_panel(16, 5, 2)))
    r = client.get("/api/panels/positions", params={"length": 8, "d_model": 4})
    assert r.status_code == 200 and r.json()["encoding"] == panels.positions_panel(8, 4)["encoding"]
    r = client.get("/api/panels/masks", params={"text": "a b c\nd e"})
    assert r.status_code == 200 and r.json()["decoder"][1][2] == [True, True, False]
    r = client.get("/api/panels/schedule", params={"d_model": "64", "warmup": "100", "steps": 500})
    assert r.status_code == 200 and r.json()["curves"] == panels.schedule_panel("64", "100", 500)["curves"]
    r = client.get("/api/panels/smoothing", params={"epsilon": 0.2, "vocab": 4, "gold": 1})
    assert r.status_code == 200 and r.json()["target"] == panels.smoothing_panel(0.2, 4, 1)["target"]
    r = client.get("/api/panels/cost")
    assert r.status_code == 200 and r.json()["layers_note"] == "no results yet: run `qkv bench layers`"


@pytest.mark.parametrize("path, params, field", [
    ("attention", {"d_k": 2048}, "d_k"), ("attention", {"d_k": "abc"}, "d_k"), ("attention", {"n_keys": 0}, "n_keys"),
    ("positions", {"d_model": 7}, "d_model"), ("positions", {"length": "1e9"}, "length"),
    ("masks", {"text": "a\nb\nc\nd"}, "text"), ("cost", {"layers_file": "nope.json"}, "file"),
    ("cost/measure", {"layers": "bogus"}, "layers"), ("cost/measure", {"n_max": 4096}, "n_max"),
    ("schedule", {"d_model": "x"}, "d_model"), ("schedule", {"steps": "many"}, "steps"),
    ("smoothing", {"epsilon": "nan"}, "epsilon"), ("smoothing", {"gold": 99}, "gold"),
])
def test_bad_parameters_get_422_naming_the_field(client, path, params, field):
    r = client.get(f"/api/panels/{path}", params=params)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail.startswith(f"{field}: ") and "\n" not in detail


def test_a_second_measurement_while_one_runs_gets_409(client):
    assert panels._measuring.acquire(blocking=False)
    try:
        r = client.get("/api/panels/cost/measure", params={"d": 16, "n_max": 16})
    finally:
        panels._measuring.release()
    assert r.status_code == 409 and "running already" in r.json()["detail"]


# --- the fragment --------------------------------------------------------------------------------------

def test_fragment_has_one_closed_section_per_panel_and_no_outside_host():
    html = panels.fragment()
    assert re.findall(r'<section[^>]*\bid="panel-([a-z]+)"', html) == [
        "attention", "positions", "masks", "steps", "model", "gates", "gradients", "schedule", "smoothing", "cost"]
    for section in re.findall(r"<section.*?</section>", html, flags=re.S):
        assert len(re.findall(r"<details\b([^>]*)>", section)) == 1
        assert "open" not in re.search(r"<details\b([^>]*)>", section)[1]  # closed until the learner opens it
    assert "http" not in html.lower() and "//" not in "".join(re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', html))
    # its own script, after the charts' (plot.js, which defines window.QkvPlot once however often inlined)
    assert not re.search(r"<(html|head|body|link)\b", html) and html.count("<script") == 2
    assert html.startswith("<script>\n// qkv lab's charts") and "window.QkvPlot = window.QkvPlot ||" in html
    style = re.search(r"<style>(.*?)</style>", html, flags=re.S)[1]
    selectors = [s.strip() for rule in re.findall(r"([^{}]+)\{", style) for s in rule.split(",")]
    assert selectors and all(s.startswith(".panels") for s in selectors), selectors


def test_fragment_fetches_only_registered_routes(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI

    from qkv.lab.app import create_app
    from qkv.lab.runs import Lab

    app = FastAPI()
    panels.register(app)
    routes = set(app.openapi()["paths"])
    fetched = {"/api/panels/" + p for p in re.findall(r'get\("([a-z/]+)"', panels.fragment())}
    names = ("attention", "positions", "masks", "cost", "cost/measure", "schedule", "smoothing")
    assert fetched == routes == {"/api/panels/" + p for p in names}
    # the run panels: POST /api/runs/NAME/WHAT of the lab's app, and its list of runs
    lab_routes = create_app(Lab(tmp_path / "runs"), panels=None).openapi()["paths"]
    posted = set(re.findall(r'post\(\w+, "([a-z]+)"', panels.fragment()))
    assert posted == {"steps", "inside", "gates", "gradients"}
    assert all("post" in lab_routes[f"/api/runs/{{name}}/{p}"] for p in posted)
    assert '"/api/runs"' in panels.fragment() and "get" in lab_routes["/api/runs"]
