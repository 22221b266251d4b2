"""The local cluster's node heartbeat period: only the heartbeat stage's delay changes."""

from __future__ import annotations

import yaml

from localstack import cluster as localcluster


def stages(path) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(path.read_text())}


def test_a_heartbeat_period_rewrites_only_the_heartbeat_stages_delay(tmp_path):
    cluster = localcluster.LocalCluster(workdir=tmp_path, bin_dir=tmp_path, node_heartbeat_seconds=60)
    written = cluster._kwok_stages()
    assert written.parent == tmp_path
    ours, base = stages(written), stages(localcluster.ROOT / "hack" / "kwok-stages.yaml")
    delay = ours["node-heartbeat"]["spec"]["delay"]
    assert delay == {"durationMilliseconds": 60000, "jitterDurationMilliseconds": 90000}
    assert base["node-heartbeat"]["spec"]["delay"]["durationMilliseconds"] == 10000
    del ours["node-heartbeat"]["spec"]["delay"], base["node-heartbeat"]["spec"]["delay"]
    assert ours == base  # every other stage, and the heartbeat's status template, as the file has them


def test_without_a_period_the_stages_file_is_used_as_it_is(tmp_path):
    cluster = localcluster.LocalCluster(workdir=tmp_path, bin_dir=tmp_path)
    assert cluster._kwok_stages() == localcluster.ROOT / "hack" / "kwok-stages.yaml"
    assert not list(tmp_path.iterdir())
