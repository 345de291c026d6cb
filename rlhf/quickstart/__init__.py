"""Quickstart fixtures: everything ``model.path=tiny://quickstart`` and ``data.*_files=embedded://...``
need, so the pipeline runs on a laptop CPU with no download.  The core build path reaches them only
through the hook in :mod:`rlhf.quickstart.resolve` (``resolve_model(cfg)``, ``resolve_data(cfg, split)``).

Modules::

    rlhf.quickstart.resolve:    resolve_model, resolve_data (the hook: quickstart URIs -> plain paths)
    rlhf.quickstart.tiny:       make_tiny_tokenizer, save_tiny_tokenizer, build_tiny_hf_model,
                                make_tiny_hf_model, TINY_CONFIGS (also the tests' tiny models)
    rlhf.quickstart.model:      build_quickstart_model, resolve_model_path, QUICKSTART_DEFAULTS
    rlhf.quickstart.tokenizer:  make_quickstart_tokenizer, prompt_ids, encode_example
    rlhf.quickstart.sft:        sft_warmup, response_loss, corrupt_answers
    rlhf.quickstart.evaluate:   evaluate_model
    rlhf.quickstart.arithmetic: make_arithmetic_dataset, write_arithmetic_parquet, quickstart_task_kwargs,
                                make_synthetic_preference_dataset, QUICKSTART_TASK, BOXED_TASK (MATH-style),
                                write_math_parquet (verl's MATH layout)

Importing the package is cheap: only the hook is imported here (it imports the rest when used).
"""

from .resolve import resolve_data, resolve_model

__all__ = ["resolve_model", "resolve_data"]
