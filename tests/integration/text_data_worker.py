"""A replica's data loading, for test_text_data_procs: import everything, say it is
ready, wait for the go file, load the split (counting the Hugging Face tokenizer's
calls, each slowed so that loads overlap), print one JSON line."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from phalanx.config.data import DataSection
from phalanx.data.text import load_text_data


def main() -> None:
    spec_json, tok_dir, ready, go = sys.argv[1:5]
    calls = [0]
    real = PreTrainedTokenizerBase.__call__

    def counted(self, *a, **kw):  # type: ignore[no-untyped-def]
        calls[0] += 1
        time.sleep(1.0)
        return real(self, *a, **kw)

    PreTrainedTokenizerBase.__call__ = counted  # type: ignore[method-assign]
    Path(ready).touch()
    deadline = time.monotonic() + 300
    while not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the go file never came")
        time.sleep(0.02)
    data = load_text_data(DataSection.model_validate_json(spec_json), tok_dir)
    ids, labels = data.batch(range(len(data)))
    digest = hashlib.sha256(ids.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
    print(json.dumps({"calls": calls[0], "digest": digest, "samples": len(data)}))


if __name__ == "__main__":
    main()
