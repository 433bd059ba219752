"""Tests for edgetrain.data: dataset specs, the synthetic dataset, CIFAR-10 loading and batches."""

import hashlib
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgetrain.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    HARD_RECIPE,
    DatasetSpec,
    HardRecipe,
    InMemoryImages,
    SyntheticCIFAR10,
    SyntheticHardCIFAR10,
    dataset_is_synthetic,
    load_dataset,
    make_batch,
)
from edgetrain.dataset_import import import_cifar10
from edgetrain.models import build_model


@pytest.fixture
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fake_cifar10(root, *, images_per_batch: int) -> None:
    """Write CIFAR-10-format python batches of random images under ``root``."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "data": rng.integers(0, 256, (images_per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, images_per_batch).tolist(),
        }
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "batches.meta").write_bytes(
        pickle.dumps({"label_names": [str(i) for i in range(10)]})
    )
    import_cifar10(folder, root)  # in place: checks the files and writes their manifest


def test_spec_defaults_to_full_splits():
    spec = DatasetSpec(name="cifar10")

    assert spec.split_size(train=True) == 50_000
    assert spec.split_size(train=False) == 10_000
    assert DatasetSpec(name="synthetic", train_size=64).split_size(train=True) == 64


def test_spec_rejects_names_no_dataset_can_have_and_names_the_valid_ones():
    for name in ("ImageNet", "../etc", "", "a" * 65):
        with pytest.raises(ValueError, match="synthetic.*cifar10.*imported"):
            DatasetSpec(name=name)
    assert DatasetSpec(name="lab-cams").imported and not DatasetSpec(name="cifar10").imported


@pytest.mark.parametrize("field", ["train_size", "test_size"])
def test_spec_rejects_non_positive_sizes(field):
    with pytest.raises(ValueError, match=field):
        DatasetSpec(name="synthetic", **{field: 0})


def test_spec_is_keyword_only_and_frozen():
    spec = DatasetSpec(name="synthetic")

    with pytest.raises(TypeError):
        DatasetSpec("synthetic")
    with pytest.raises(AttributeError):
        spec.seed = 1


def test_dataset_is_synthetic():
    assert dataset_is_synthetic(DatasetSpec(name="synthetic"))
    assert dataset_is_synthetic(DatasetSpec(name="synthetic-hard"))
    assert not dataset_is_synthetic(DatasetSpec(name="cifar10"))


def test_load_dataset_synthetic_respects_sizes():
    spec = DatasetSpec(name="synthetic", train_size=120, test_size=30, seed=5)

    train, test = load_dataset(spec, train=True), load_dataset(spec, train=False)

    assert (len(train), len(test)) == (120, 30)
    assert isinstance(train, SyntheticCIFAR10) and train.seed == 5 and train.train
    assert not test.train


def test_synthetic_item_format():
    image, label = SyntheticCIFAR10(train=True, size=10, seed=0)[3]

    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert isinstance(label, int) and 0 <= label < 10


def test_synthetic_items_are_a_function_of_seed_split_and_index():
    # Prepare
    first = SyntheticCIFAR10(train=True, size=100, seed=7)
    second = SyntheticCIFAR10(train=True, size=50_000, seed=7)

    # Execute
    image, label = first[42]
    again, label_again = second[42]

    # Assert
    assert torch.equal(image, again) and label == label_again
    assert not torch.equal(image, SyntheticCIFAR10(train=True, size=100, seed=8)[42][0])
    assert not torch.equal(image, SyntheticCIFAR10(train=False, size=100, seed=7)[42][0])
    assert not torch.equal(image, first[43][0])


def test_synthetic_items_match_golden_values():
    # Items must be the same on every machine and in every release: a change here changes data.
    dataset = SyntheticCIFAR10(train=True, size=100, seed=0)

    digest = hashlib.sha256(dataset.pixels(99).numpy().tobytes()).hexdigest()

    assert [dataset.label(i) for i in range(10)] == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    assert digest.startswith("1a08169f22f2c960")


def test_synthetic_labels_are_balanced_and_not_periodic():
    dataset = SyntheticCIFAR10(train=True, size=1000, seed=0)

    labels = [dataset.label(i) for i in range(1000)]

    assert Counter(labels) == {c: 100 for c in range(10)}
    assert labels[:10] != labels[10:20]
    assert labels == [dataset[i][1] for i in range(1000)]


def test_synthetic_index_out_of_range():
    with pytest.raises(IndexError):
        SyntheticCIFAR10(train=True, size=10, seed=0)[10]


def test_cifar10_missing_raises_helpful_error(tmp_path):
    spec = DatasetSpec(name="cifar10", data_dir=str(tmp_path / "nowhere"))

    with pytest.raises(FileNotFoundError, match="nowhere.*--download.*'synthetic'"):
        load_dataset(spec, train=True)


def test_cifar10_loads_in_memory_and_normalises(tmp_path):
    # Prepare: a tiny dataset in the real file format; its checksums cannot match the real ones.
    _fake_cifar10(tmp_path, images_per_batch=4)
    spec = DatasetSpec(name="cifar10", data_dir=str(tmp_path), train_size=18, test_size=3)

    # Execute
    train, test = load_dataset(spec, train=True), load_dataset(spec, train=False)
    image, label = train[17]

    # Assert
    assert isinstance(train, InMemoryImages) and (len(train), len(test)) == (18, 3)
    assert train.images.dtype == torch.uint8 and train.images.shape == (18, 3, 32, 32)
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    assert torch.allclose(image, (train.images[17].float() / 255 - mean) / std)
    assert label == int(train.labels[17])


def test_cifar10_rejects_more_samples_than_exist(tmp_path):
    _fake_cifar10(tmp_path, images_per_batch=2)

    with pytest.raises(ValueError, match="has 2"):
        load_dataset(DatasetSpec(name="cifar10", data_dir=str(tmp_path), test_size=3), train=False)
    assert len(load_dataset(DatasetSpec(name="cifar10", data_dir=str(tmp_path)), train=False)) == 2  # unset: all


def test_make_batch_without_augmentation_stacks_items_in_order():
    dataset = SyntheticCIFAR10(train=True, size=20, seed=0)

    images, labels = make_batch(dataset, [5, 2, 5], augment=False, seed=0, step=0)

    assert torch.equal(images[1], dataset[2][0]) and torch.equal(images[2], dataset[5][0])
    assert labels.dtype == torch.int64 and labels.tolist() == [dataset.label(i) for i in [5, 2, 5]]


def test_make_batch_is_deterministic_and_depends_on_step():
    dataset = SyntheticCIFAR10(train=True, size=64, seed=0)
    indices = list(range(0, 64, 3))

    first = make_batch(dataset, indices, augment=True, seed=1, step=4)
    second = make_batch(dataset, indices, augment=True, seed=1, step=4)
    next_step = make_batch(dataset, indices, augment=True, seed=1, step=5)

    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], next_step[0])


def test_augmentation_of_a_sample_does_not_depend_on_its_batch():
    # Prepare
    dataset = SyntheticCIFAR10(train=True, size=64, seed=0)
    indices = [9, 31, 2, 47, 18]

    # Execute
    batched, _ = make_batch(dataset, indices, augment=True, seed=3, step=11)
    shards = [make_batch(dataset, indices[:2], augment=True, seed=3, step=11)[0]]
    shards.append(make_batch(dataset, indices[2:], augment=True, seed=3, step=11)[0])
    alone = [make_batch(dataset, [i], augment=True, seed=3, step=11)[0] for i in indices]

    # Assert
    assert torch.equal(batched, torch.cat(shards))
    assert torch.equal(batched, torch.cat(alone))


def _crop_and_flip_candidates(image: torch.Tensor) -> list[torch.Tensor]:
    """Every 32x32 crop of the 4-pixel zero-padded image, mirrored and not."""
    padded = F.pad(image, (4, 4, 4, 4))
    crops = [padded[:, top : top + 32, left : left + 32] for top in range(9) for left in range(9)]
    return crops + [crop.flip(-1) for crop in crops]


def test_augmentation_is_a_padded_crop_with_optional_flip():
    # Prepare
    dataset = SyntheticCIFAR10(train=True, size=40, seed=0)
    indices = list(range(40))

    # Execute
    images, _ = make_batch(dataset, indices, augment=True, seed=0, step=0)

    # Assert
    plain = [dataset[i][0] for i in indices]
    for augmented, original in zip(images, plain, strict=True):
        assert any(torch.equal(augmented, c) for c in _crop_and_flip_candidates(original))
    assert sum(torch.equal(a, p) for a, p in zip(images, plain, strict=True)) < len(indices) // 2


def test_make_batch_rejects_empty_indices():
    with pytest.raises(ValueError):
        make_batch(SyntheticCIFAR10(train=True, size=4, seed=0), [], augment=True, seed=0, step=0)


def test_small_cnn_learns_synthetic_data(single_thread):
    # Prepare
    spec = DatasetSpec(name="synthetic", train_size=2000, test_size=1000)
    train, test = load_dataset(spec, train=True), load_dataset(spec, train=False)
    model = build_model("small_cnn", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    order = torch.Generator().manual_seed(0)

    # Execute
    for step in range(150):
        indices = torch.randint(0, len(train), (32,), generator=order).tolist()
        images, labels = make_batch(train, indices, augment=True, seed=0, step=step)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    # Assert
    images, labels = make_batch(test, range(len(test)), augment=False, seed=0, step=0)
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    assert accuracy > 0.5


def test_load_dataset_synthetic_hard_respects_sizes():
    spec = DatasetSpec(name="synthetic-hard", train_size=120, test_size=30, seed=5)

    train, test = load_dataset(spec, train=True), load_dataset(spec, train=False)
    image, label = train[7]

    assert isinstance(train, SyntheticHardCIFAR10) and (len(train), len(test)) == (120, 30)
    assert train.seed == 5 and train.train and not test.train
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == train.label(7)


def test_synthetic_hard_items_are_a_function_of_seed_split_and_index():
    first = SyntheticHardCIFAR10(train=True, size=100, seed=7)
    second = SyntheticHardCIFAR10(train=True, size=50_000, seed=7)

    assert torch.equal(first.pixels(42), second.pixels(42)) and first.label(42) == second.label(42)
    assert not torch.equal(first.pixels(42), SyntheticHardCIFAR10(train=True, size=100, seed=8).pixels(42))
    assert not torch.equal(first.pixels(42), SyntheticHardCIFAR10(train=False, size=100, seed=7).pixels(42))
    assert not torch.equal(first.pixels(42), first.pixels(43))


def test_synthetic_hard_items_match_golden_values():
    # Computed once in another process: every process, machine and release must get these bytes.
    dataset = SyntheticHardCIFAR10(train=True, size=400, seed=3)

    digest = hashlib.sha256()
    for i in range(0, 400, 37):
        digest.update(dataset.pixels(i).numpy().tobytes() + bytes([dataset.label(i)]))

    assert [dataset.label(i) for i in range(10)] == [8, 9, 0, 1, 2, 3, 4, 5, 6, 7]
    assert digest.hexdigest().startswith("5491a52e2554d6aa")


def test_synthetic_hard_labels_are_balanced_in_every_block():
    for train in (True, False):
        dataset = SyntheticHardCIFAR10(train=train, size=1000, seed=0)

        labels = [dataset.label(i) for i in range(1000)]
        classes = [dataset.clean_label(i) for i in range(1000)]

        for begin in range(0, 1000, 10):
            assert sorted(labels[begin : begin + 10]) == list(range(10))
            assert sorted(classes[begin : begin + 10]) == list(range(10))
        assert labels[::97] == [dataset[i][1] for i in range(0, 1000, 97)]
        assert labels[:10] != labels[10:20]


def test_synthetic_hard_mislabels_a_few_training_items_and_no_test_items():
    # Prepare
    train = SyntheticHardCIFAR10(train=True, size=2000, seed=1)
    test = SyntheticHardCIFAR10(train=False, size=2000, seed=1)

    # Execute
    wrong = [i for i in range(2000) if train.label(i) != train.clean_label(i)]

    # Assert: exactly the recipe's percent in every aligned 100 items, as swapped pairs in a block
    percent = HARD_RECIPE.label_noise_percent
    assert percent > 0 and len(wrong) == 2000 * percent // 100
    assert all(sum(1 for i in wrong if i // 100 == run) == percent for run in range(20))
    for i in wrong:
        partner = next(j for j in wrong if j != i and j // 10 == i // 10)
        assert train.label(i) == train.clean_label(partner) and train.label(partner) == train.clean_label(i)
    assert all(test.label(i) == test.clean_label(i) for i in range(2000))


def test_hard_recipe_rejects_odd_label_noise():
    with pytest.raises(ValueError, match="label_noise_percent"):
        HardRecipe(label_noise_percent=3)


def _nearest_class_mean_accuracy(train, test) -> float:
    """Test accuracy of classifying raw pixels by the nearest training class mean."""
    x = torch.stack([train.pixels(i) for i in range(len(train))]).float().flatten(1)
    y = torch.tensor([train.label(i) for i in range(len(train))])
    means = torch.stack([x[y == c].mean(dim=0) for c in range(10)])
    x_test = torch.stack([test.pixels(i) for i in range(len(test))]).float().flatten(1)
    y_test = torch.tensor([test.label(i) for i in range(len(test))])
    return (torch.cdist(x_test, means).argmin(dim=1) == y_test).float().mean().item()


def test_synthetic_hard_is_not_separable_by_class_means(single_thread):
    easy = _nearest_class_mean_accuracy(SyntheticCIFAR10(train=True, size=500, seed=0),
                                        SyntheticCIFAR10(train=False, size=300, seed=0))
    hard = _nearest_class_mean_accuracy(SyntheticHardCIFAR10(train=True, size=500, seed=0),
                                        SyntheticHardCIFAR10(train=False, size=300, seed=0))

    # Measured: 0.99 on synthetic, 0.32 here (0.32 to 0.35 over seeds 0-2).
    assert easy > 0.95
    assert hard < 0.5
