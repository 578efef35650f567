"""Run by tests/train/test_loop.py under ``torch.distributed.run``: train a tiny model, dump the result."""

import json
import sys

from sv_attention.train.config import TrainConfig
from sv_attention.train.loop import train


def main() -> None:
    cfg = TrainConfig.load(sys.argv[1])
    result = train(cfg, progress=False)
    from accelerate import PartialState

    if PartialState().is_main_process:
        losses = [e["loss"] for e in result.history if e["event"] == "train"]
        json.dump({"losses": losses, "val_bpb": result.val_bpb, "processes": result.summary["processes"]},
                  open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
