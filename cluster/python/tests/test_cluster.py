"""Training from Python on a cluster of worker processes that `legion-rs up` started."""

import os
import socket
import subprocess

import numpy as np
import pytest

import legion_rs
from conftest import required


@pytest.fixture
def legion_rs_binary():
    binary = os.environ.get("LEGION_RS_BIN")
    if not binary or not os.path.exists(binary):
        reason = f"no legion-rs binary to start workers with (LEGION_RS_BIN={binary!r})"
        if required("python"):
            pytest.fail(f"LEGION_REQUIRE requires python here, but: {reason}")
        pytest.skip(reason)
    return binary


def free_ports(count):
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_workers_started_by_up_train_what_one_device_trains(legion_rs_binary, tmp_path):
    hosts = tmp_path / "hosts.toml"
    lines = ['[defaults]\ndevices = 2\ndevice = "cpu"\n']
    for i, port in enumerate(free_ports(2)):
        lines.append(f'[[host]]\nname = "w{i}"\naddress = "127.0.0.1"\nport = {port}\n')
    hosts.write_text("\n".join(lines))
    state = tmp_path / "state"
    up = [legion_rs_binary, "up", str(hosts), "--state", str(state)]
    subprocess.run(up, check=True, capture_output=True, timeout=120)
    try:
        rng = np.random.default_rng(3)
        batches = [(rng.standard_normal((8, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 8))
                   for _ in range(3)]
        on_cluster = legion_rs.train("lenet5", batches, batch=8, cluster=hosts, cluster_state=state,
                                     strategy="owt", progress=False)
        assert on_cluster.summary["devices"] == 4
        assert "2 worker(s)" in on_cluster.summary["plan"]["place"]
        one = legion_rs.train("lenet5", batches, batch=8, device="cpu", progress=False)
        for name, value in one.items():
            np.testing.assert_allclose(np.asarray(on_cluster[name]), np.asarray(value), rtol=1e-4,
                                       atol=1e-5, err_msg=name)
        # Data the workers read themselves, or this process sends them (data_on_driver).
        runs = {driver: legion_rs.train("lenet5", "synthetic:64", batch=8, steps=3, cluster=hosts,
                                        cluster_state=state, strategy="data",
                                        data_on_driver=driver, progress=False)
                for driver in (False, True)}
        one = legion_rs.train("lenet5", "synthetic:64", batch=8, steps=3, device="cpu",
                              progress=False)
        for run in runs.values():
            for name, value in one.items():
                np.testing.assert_allclose(np.asarray(run[name]), np.asarray(value), rtol=1e-4,
                                           atol=1e-5, err_msg=name)
        sent = {driver: run.summary["input_bytes_per_step"] for driver, run in runs.items()}
        assert sent[False] < 1024 * 8 < 4 * 8 * 28 * 28 <= sent[True], sent
        plan = legion_rs.plan("lenet5", cluster=hosts, cluster_state=state, batch=8)
        assert plan.to_dict()["devices"] == 4 and plan.search == "optcnn"
    finally:
        subprocess.run([legion_rs_binary, "down", str(hosts), "--state", str(state)],
                       capture_output=True, timeout=60)
