"""Write a dataset into the local HF datasets cache exactly where ``datasets.load_dataset("owner/name", config)``
finds it offline (HF_DATASETS_OFFLINE=1): ``<cache>/<owner>___<name>/<config>/0.0.0/<hash>/`` with
``dataset_info.json`` and ``<name>-<split>.arrow`` files, as a hub download leaves them.  No network."""
from __future__ import annotations

import glob
import os
import shutil


def save_in_hf_cache(splits: dict, repo_id: str, config: str, cache_dir: str) -> str:
    """`splits`: split name -> list of row dicts.  Returns the prepared directory."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, name = repo_id.split("/")
    src = os.path.join(cache_dir, "_src", name)
    os.makedirs(src, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = os.path.join(src, f"{split}.parquet")
        datasets.Dataset.from_list(rows).to_parquet(files[split])
    builder = Parquet(cache_dir=cache_dir, dataset_name=name, config_name=config, hash="0123abcd", data_files=files)
    builder.download_and_prepare()
    (built,) = glob.glob(os.path.join(cache_dir, name, f"{config}*"))
    target = os.path.join(cache_dir, f"{owner}___{name}", config)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.move(built, target)  # a hub download's config directory is named by the config alone
    shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return target
