"""Read metrics back from what the loggers wrote: TensorBoard event files, an offline wandb run, an mlflow
file store.  Used by the tracking, validation and end-to-end tests."""
from __future__ import annotations

import glob
import json
import os
import struct
import time


def tensorboard(log_dir: str) -> dict:
    """{"scalars": {(tag, step): value}, "histograms": {(tag, step): (count, sum)}, "text": {(tag, step): str}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {"scalars": {}, "histograms": {}, "text": {}}
    # events.out.tfevents.<seconds>.<host>.<pid>.<n>, read in the order the runs wrote them: a step logged by
    # several runs (redone after a resume) keeps the last run's value
    for f in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")),
                    key=lambda f: (int(os.path.basename(f).split(".")[3]), os.path.getmtime(f))):
        acc = EventAccumulator(f, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags["scalars"]:
            for e in acc.Scalars(tag):
                out["scalars"][(tag, e.step)] = e.value
        for tag in tags["histograms"]:
            for e in acc.Histograms(tag):
                out["histograms"][(tag, e.step)] = (e.histogram_value.num, e.histogram_value.sum)
        for tag in tags["tensors"]:
            for e in acc.Tensors(tag):
                if e.tensor_proto.string_val:
                    out["text"][(tag.rsplit("/text_summary", 1)[0], e.step)] = e.tensor_proto.string_val[0].decode()
    return out


def run_scalars(run_dir: str) -> dict:
    """{(tag, step): value} of the scalars a trainer run wrote under `run_dir`/tensorboard."""
    return tensorboard(os.path.join(run_dir, "tensorboard"))["scalars"]


def run_series(run_dir: str) -> dict:
    """{tag: {step: value}}: :func:`run_scalars` grouped by tag."""
    out: dict = {}
    for (tag, step), value in run_scalars(run_dir).items():
        out.setdefault(tag, {})[step] = value
    return out


def _wandb_records(path: str) -> list[bytes]:
    """The records of a ``run-*.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-style log
    blocks of 32 KiB whose records carry a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    return records


def wandb_offline(run_root: str) -> dict:
    """{"scalars": {(key, step): float}, "media": {(key, step): _type}, "config": dict} of the one offline run
    under ``run_root/wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_root, "wandb", "offline-run-*", "run-*.wandb"))
    # run.finish() returns once wandb-core handled the exit record, but its writer flushes and closes the file
    # after (inform_finish is not waited for): under load a read right after finish() saw only the first history
    # row.  Wait for the exit record.
    deadline, records = time.monotonic() + 60, []
    while True:
        records = [pb.Record.FromString(raw) for raw in _wandb_records(path)]
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert any(r.WhichOneof("record_type") == "exit" for r in records), f"{path} has no exit record after 60 s"
    out = {"scalars": {}, "media": {}, "config": {}, "run": None}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {"project": rec.run.project, "name": rec.run.display_name}
        if kind != "history":
            continue
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
        step = int(items["_step"])
        media = {k[:-len("/_type")]: v for k, v in items.items() if k.endswith("/_type")}
        out["media"].update({(k, step): v for k, v in media.items()})
        for k, v in items.items():
            if not k.startswith("_") and isinstance(v, (int, float)) and not any(k.startswith(m + "/") for m in media):
                out["scalars"][(k, step)] = float(v)
    return out


def mlflow_store(tracking_uri: str) -> dict:
    """{"scalars": {(key, step): float}, "artifacts": [paths], "experiment": name, "run_name": name} of the one
    run in the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, f"expected one mlflow run, found {len(runs)}"
    run = runs[0]
    exp = client.get_experiment(run.info.experiment_id)
    scalars = {(k, m.step): m.value for k in run.data.metrics for m in client.get_metric_history(run.info.run_id, k)}

    def walk(path=None):
        for f in client.list_artifacts(run.info.run_id, path):
            yield from (walk(f.path) if f.is_dir else [f.path])

    return {"scalars": scalars, "artifacts": sorted(walk()), "experiment": exp.name, "run_name": run.info.run_name,
            "run_id": run.info.run_id, "client": client, "params": run.data.params}
