"""The Python front without torch: plans, runs, batches from Python, errors, progress, Ctrl-C."""

import os
import pathlib
import re
import signal
import threading

import numpy as np
import pytest

import legion_rs


def numpy_batches(count, batch=8, seed=0, shape=(1, 28, 28), classes=10):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch,) + shape, dtype=np.float32), rng.integers(0, classes, batch))
        for _ in range(count)
    ]


def as_numpy(value):
    return value.numpy() if hasattr(value, "numpy") else value


def test_a_plan_is_the_cli_table_and_its_document():
    plan = legion_rs.plan("lenet5", machine="paper:4", batch=64)
    text = str(plan)
    assert text.startswith("lenet5 on paper:4"), text
    assert "optcnn: Eq.1" in text and "conv1" in text
    doc = plan.to_dict()
    assert doc["model"] == "lenet5" and doc["devices"] == 4
    assert plan.search == "optcnn"
    assert [layer["layer"] for layer in plan.layers][:2] == ["data", "conv1"]
    parts = plan.eq1_parts
    assert abs(sum(l["t_c_ms"] for l in parts["layers"]) - parts["t_c_ms"]) < 1e-6
    every = legion_rs.plan("lenet5", devices=2, batch=16, search="all")
    assert {s["search"] for s in every.searches} >= {"optcnn", "data", "owt"}
    assert every.eq1_ms <= min(s["eq1_ms"] for s in every.searches if "eq1_ms" in s) + 1e-12


def test_a_zoo_model_trains_and_returns_its_weights_by_name():
    events = []
    state = legion_rs.train("lenet5", "synthetic:256", batch=16, devices=2, strategy="data",
                            steps=4, device="cpu", progress=events.append)
    assert list(state)[:2] == ["conv1.weight", "conv1.bias"]
    assert as_numpy(state["conv1.weight"]).shape == (6, 1, 5, 5)
    summary = state.summary
    assert summary["steps"] == 4 and len(summary["losses"]) == 4
    assert summary["plan"]["choice"] == "data" and summary["plan"]["devices"] == 2
    kinds = [e["event"] for e in events if e["event"] != "search"]
    assert kinds[0] == "device" and "planned" in kinds
    assert any(e["event"] == "search" for e in events), "the search reports its phases"
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]


REPO = pathlib.Path(__file__).resolve().parents[3]

JSON_MODEL = """{"name": "tiny", "layers": [
  {"name": "data", "op": "input", "shape": [8, 3, 16, 16]},
  {"name": "conv1", "op": "conv2d", "inputs": ["data"], "out_channels": 8, "kernel": [3, 3],
   "padding": [1, 1], "activation": "relu"},
  {"name": "pool1", "op": "pool2d", "inputs": ["conv1"], "kind": "max", "kernel": [2, 2], "stride": [2, 2]},
  {"name": "flat", "op": "flatten", "inputs": ["pool1"]},
  {"name": "fc", "op": "dense", "inputs": ["flat"], "out_features": 10},
  {"name": "loss", "op": "softmax_cross_entropy", "inputs": ["fc"]}]}"""


def test_onnx_and_json_model_files_plan_and_train(tmp_path):
    onnx = REPO / "integration/onnx/exporters/torchscript_preserve.onnx"
    events = []
    state = legion_rs.train(onnx, batch=4, steps=2, devices=2, strategy="owt", device="cpu",
                            progress=events.append)
    assert any("weights from the file" in e.get("line", "") for e in events), events
    assert state.summary["steps"] == 2 and len(state) > 0
    json_model = tmp_path / "tiny.json"
    json_model.write_text(JSON_MODEL)
    plan = legion_rs.plan(json_model, devices=2, batch=8)
    assert str(plan).startswith("tiny on "), str(plan)
    trained = legion_rs.train(json_model, batch=8, steps=2, device="cpu", progress=False)
    assert as_numpy(trained["conv1.weight"]).shape == (8, 3, 3, 3)


def test_numpy_batches_train_the_same_network_under_any_strategy():
    batches = numpy_batches(3)
    runs = {
        (devices, strategy): legion_rs.train("lenet5", batches, batch=8, devices=devices,
                                             strategy=strategy, device="cpu", progress=False)
        for devices, strategy in [(1, "optcnn"), (4, "optcnn"), (4, "model"), (2, "data")]
    }
    one = runs[(1, "optcnn")]
    assert one.summary["steps"] == 3, "one pass over a list of 3 batches"
    for key, state in runs.items():
        for name, value in one.items():
            np.testing.assert_allclose(as_numpy(state[name]), as_numpy(value), rtol=1e-4,
                                       atol=1e-5, err_msg=f"{key} {name}")


def test_the_search_prices_with_measured_costs_and_verifies_on_the_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("LEGION_RS_COST_CACHE", str(tmp_path / "costs"))
    state = legion_rs.train("lenet5", batch=8, devices=4, steps=15, device="cpu", progress=False)
    plan = state.summary["plan"]
    assert plan["costs"].startswith("costs: measured, "), plan["costs"]
    assert any((tmp_path / "costs").iterdir()), "the cost cache was written"
    tried = plan["verification"]["candidates"]
    assert tried[0]["strategy"] == "optcnn" and len(tried) >= 2
    fastest = min(tried, key=lambda c: c["measured_ms"])["strategy"]
    assert plan["verification"]["kept"] == fastest
    again = legion_rs.train("lenet5", batch=8, devices=4, steps=2, device="cpu", costs="roofline",
                            verify=0, progress=False)
    assert again.summary["plan"]["costs"] == "costs: roofline; roofline because --costs roofline"
    assert again.summary["plan"]["verification"] is None
    with pytest.raises(legion_rs.LegionError, match='costs="fast"'):
        legion_rs.train("lenet5", batch=8, devices=2, costs="fast", progress=False)
    # plan prices with the same cache, and says so
    planned = legion_rs.plan("lenet5", devices=4, batch=8, costs="measured")
    assert "t_c: measured kernel times from " + str(tmp_path / "costs") in str(planned), str(planned)
    with pytest.raises(legion_rs.LegionError, match="cost cache has nothing for cpu, fp32"):
        legion_rs.plan("lenet5", devices=3, batch=8, costs="measured")


def test_epochs_pass_over_an_iterable_again_and_an_iterator_once():
    state = legion_rs.train("lenet5", numpy_batches(2), batch=8, epochs=3, device="cpu",
                            progress=False)
    assert state.summary["steps"] == 6
    with pytest.raises(legion_rs.LegionError, match="iterator, passed over once"):
        legion_rs.train("lenet5", iter(numpy_batches(2)), batch=8, epochs=2, progress=False)


def test_bad_input_is_a_located_exception():
    with pytest.raises(legion_rs.LegionError, match="neither a zoo model"):
        legion_rs.train("no-such-model", batch=4, progress=False)
    with pytest.raises(legion_rs.LegionError, match=r"batch 1: .*label 12"):
        bad = numpy_batches(2, classes=10)
        bad[1][1][0] = 12
        legion_rs.train("lenet5", bad, batch=8, device="cpu", progress=False)
    with pytest.raises(legion_rs.LegionError, match=r"batch 0: 9 labels, but the model's batch is 8"):
        legion_rs.train("lenet5", numpy_batches(1, batch=9), batch=8, device="cpu", progress=False)
    with pytest.raises(legion_rs.LegionError, match="ended after 2 batch"):
        legion_rs.train("lenet5", numpy_batches(2), batch=8, steps=5, device="cpu", progress=False)
    with pytest.raises(legion_rs.LegionError, match="unknown search 'fastest'"):
        legion_rs.plan("lenet5", devices=2, search="fastest")
    with pytest.raises(legion_rs.LegionError, match="give one of machine="):
        legion_rs.plan("lenet5")


def test_a_failing_callback_stops_the_run_and_is_raised():
    def callback(event):
        if event["event"] == "step" and event["step"] == 2:
            raise ValueError("enough")

    with pytest.raises(ValueError, match="enough"):
        legion_rs.train("lenet5", batch=8, steps=1000, device="cpu", progress=callback)


def test_ctrl_c_stops_the_run_and_saves_the_checkpoint_it_asked_for(tmp_path):
    path = tmp_path / "run.safetensors"
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            legion_rs.train("lenet5", batch=32, steps=100_000, devices=2, strategy="data",
                            device="cpu", save=path, progress=False)
    finally:
        timer.cancel()
    step = int(re.search(r"stopped after step (\d+)", str(stopped.value)).group(1))
    assert 0 < step < 100_000, stopped.value
    assert path.exists() and str(path) in str(stopped.value)
    resumed = legion_rs.train("lenet5", batch=32, steps=step + 2, devices=2, strategy="data",
                              device="cpu", resume=path, progress=False)
    assert resumed.summary["first_step"] == step and len(resumed.summary["losses"]) == 2


def test_the_interpreter_runs_other_threads_while_a_run_trains():
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        state = legion_rs.train("lenet5", batch=32, steps=30, device="cpu", progress=False)
    finally:
        done.set()
        counter.join()
    seconds = state.summary["wall_secs"]
    # About one tick a millisecond: the lock is held for a few microseconds at a time.
    assert len(ticks) > 100 * seconds, (len(ticks), seconds)
