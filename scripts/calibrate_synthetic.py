"""Calibrate the SYNTHETIC ``synthetic-hard`` tier: centralized training to a test-accuracy target.

One process trains the model on the whole global batch each step with the arithmetic the
coordinator uses (``edgetrain.sampling.batch_indices`` for the batch, ``make_batch`` with the
seeded crop-and-flip, ``edgetrain.training.compute_shard`` for the gradient and buffers,
``make_optimizer`` / ``set_learning_rate`` for SGD, ``evaluate`` on the test split): what a
one-board ``edgetrain local`` run at speed 1.0 computes, without the processes and the network.
It evaluates every half epoch (and ``--eval-every`` epochs in general), prints the test accuracy
each time and the epoch at which the target is first passed; the last line is one JSON object.

    nice -n 10 .venv/bin/python scripts/calibrate_synthetic.py                 # MobileNetV2
    nice -n 10 .venv/bin/python scripts/calibrate_synthetic.py --model resnet18
    .venv/bin/python scripts/calibrate_synthetic.py --epochs 1.5 --set noise_half_width=64

``--set FIELD=VALUE`` overrides a field of the tier's recipe (``edgetrain.data.HardRecipe``), for
trying parameters before changing the calibrated ones. The data is SYNTHETIC, not CIFAR-10.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from edgetrain.catalog import (  # noqa: E402
    SYNTHETIC_HARD_TARGET,
    SYNTHETIC_HARD_TEST_SIZE,
    SYNTHETIC_HARD_TRAIN_SIZE,
    DatasetSpec,
)
from edgetrain.config import OptimizerConfig  # noqa: E402
from edgetrain.data import (  # noqa: E402
    HARD_RECIPE,
    InMemoryImages,
    SyntheticHardCIFAR10,
    load_dataset,
    make_batch,
)
from edgetrain.models import build_model  # noqa: E402
from edgetrain.sampling import batch_indices  # noqa: E402
from edgetrain.training import compute_shard, evaluate, make_optimizer, set_learning_rate  # noqa: E402

EVAL_CHUNK = 250
"""Test images per forward pass when evaluating (bounds memory; eval mode, so no effect on results)."""


def _recipe_overrides(pairs: list[str]) -> dict[str, object]:
    """``FIELD=VALUE`` pairs as recipe fields (integers, or ``low,high`` for ranges)."""
    fields = {f.name for f in dataclasses.fields(HARD_RECIPE)}
    out: dict[str, object] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"error: --set {pair!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            out[name] = tuple(int(v) for v in value.split(",")) if "," in value else int(value)
        except ValueError:
            raise SystemExit(f"error: --set {pair!r}: value must be an integer or low,high") from None
    return out


def _in_memory(dataset) -> InMemoryImages:
    """The split generated once as uint8 images: its items equal the generator's exactly."""
    images = torch.stack([dataset.pixels(i) for i in range(len(dataset))])
    labels = torch.tensor([dataset.label(i) for i in range(len(dataset))])
    return InMemoryImages(images, labels)


def _test_accuracy(model: torch.nn.Module, test: InMemoryImages) -> tuple[float, float]:
    """(accuracy, mean loss) over the whole test split."""
    loss_sum, correct = 0.0, 0
    for begin in range(0, len(test), EVAL_CHUNK):
        x, y = make_batch(test, range(begin, min(begin + EVAL_CHUNK, len(test))), augment=False, seed=0, step=0)
        loss, right = evaluate(model, x, y)
        loss_sum, correct = loss_sum + loss, correct + right
    return correct / len(test), loss_sum / len(test)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--dataset", default="synthetic-hard", choices=("synthetic-hard", "synthetic"))
    parser.add_argument("--train-size", type=int, default=SYNTHETIC_HARD_TRAIN_SIZE)
    parser.add_argument("--test-size", type=int, default=SYNTHETIC_HARD_TEST_SIZE)
    parser.add_argument("--seed", type=int, default=0, help="data seed and model seed")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--schedule", default="constant", choices=("constant", "cosine"))
    parser.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    parser.add_argument("--epochs", type=float, default=6.0, help="train this long (cosine reaches 0 here)")
    parser.add_argument("--eval-every", type=float, default=0.5, help="epochs between evaluations")
    parser.add_argument("--target", type=float, default=SYNTHETIC_HARD_TARGET)
    parser.add_argument("--stop-at-target", action="store_true", help="stop at the first evaluation past it")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="recipe override")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    overrides = _recipe_overrides(args.set)
    spec = DatasetSpec(name=args.dataset, seed=args.seed, train_size=args.train_size, test_size=args.test_size)
    if args.dataset == "synthetic-hard":
        recipe = dataclasses.replace(HARD_RECIPE, **overrides)
        train_source = SyntheticHardCIFAR10(train=True, size=args.train_size, seed=args.seed, recipe=recipe)
        test_source = SyntheticHardCIFAR10(train=False, size=args.test_size, seed=args.seed, recipe=recipe)
    elif overrides:
        raise SystemExit("error: --set applies to synthetic-hard only")
    else:
        recipe = None
        train_source, test_source = load_dataset(spec, train=True), load_dataset(spec, train=False)
    started = time.perf_counter()
    train, test = _in_memory(train_source), _in_memory(test_source)
    generate_s = time.perf_counter() - started
    per_item_us = generate_s / (len(train) + len(test)) * 1e6
    print(f"SYNTHETIC data ({args.dataset}, not CIFAR-10): {len(train)} train / {len(test)} test items "
          f"generated in {generate_s:.1f} s ({per_item_us:.0f} us/item)", flush=True)

    model = build_model(args.model, seed=args.seed)
    cfg = OptimizerConfig(lr=args.lr, momentum=0.9, weight_decay=5e-4, schedule=args.schedule,
                          warmup_steps=args.warmup)
    optimizer = make_optimizer(model, cfg)
    total_steps = math.ceil(args.epochs * len(train) / args.batch)
    eval_steps = sorted({min(total_steps, math.ceil(k * args.eval_every * len(train) / args.batch))
                         for k in range(1, math.ceil(args.epochs / args.eval_every) + 1)})
    history: list[dict] = []
    reached_epoch = None
    train_started = time.perf_counter()
    for step in range(total_steps):
        set_learning_rate(optimizer, step, total_steps, cfg)
        indices = batch_indices(step, args.batch, len(train), args.seed)
        x, y = make_batch(train, indices, augment=spec.augment, seed=args.seed, step=step)
        result = compute_shard(model, x, y)
        optimizer.step()
        if step + 1 in eval_steps:
            accuracy, loss = _test_accuracy(model, test)
            epoch = (step + 1) * args.batch / len(train)
            elapsed = time.perf_counter() - train_started
            history.append({"epoch": round(epoch, 3), "step": step + 1, "test_accuracy": accuracy,
                            "test_loss": round(loss, 4), "train_loss": round(result.loss, 4),
                            "elapsed_s": round(elapsed, 1)})
            print(f"epoch {epoch:5.2f}  step {step + 1:5d}  test accuracy {accuracy:.3f}  test loss {loss:.3f}  "
                  f"train loss {result.loss:.3f}  ({elapsed:.0f} s)", flush=True)
            if reached_epoch is None and accuracy >= args.target:
                reached_epoch = epoch
                print(f"target {args.target:.2f} first passed at epoch {epoch:.2f} (step {step + 1})", flush=True)
                if args.stop_at_target:
                    break
    if reached_epoch is None:
        print(f"target {args.target:.2f} not reached in {args.epochs} epochs", flush=True)
    train_s = time.perf_counter() - train_started
    print(json.dumps({
        "synthetic_data": True, "dataset": args.dataset, "model": args.model, "seed": args.seed,
        "train_size": len(train), "test_size": len(test), "global_batch": args.batch, "lr": args.lr,
        "momentum": 0.9, "weight_decay": 5e-4, "warmup_steps": args.warmup, "schedule": args.schedule,
        "epochs": args.epochs, "target": args.target, "target_epoch": reached_epoch,
        "recipe": dataclasses.asdict(recipe) if recipe else None, "generate_us_per_item": round(per_item_us),
        "train_s": round(train_s, 1), "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "history": history,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
