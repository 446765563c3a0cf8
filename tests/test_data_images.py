"""Image splits: decoded once into a uint8 cache, scaled inside the step, from any source."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from image_support import png_dataset, png_parquet

from nnx_cli.config import DataConfig
from nnx_cli.data.images import (
    SOURCES,
    ImageArrays,
    ImageEvalSplit,
    ImageTrainSplit,
    _chunk_decoder,
    image_eval_split,
    image_train_split,
    load_images,
)
from nnx_cli.errors import UserError
from nnx_cli.pixels import ArrowImages, DatasetImages, decoded


def parquet_config(tmp_path: Path, n: int = 40, **options) -> tuple[DataConfig, np.ndarray]:
    """A parquet file of `n` 6x5 grey PNGs every level 0..255 appears in, and a config reading it."""
    pixels = png_parquet(tmp_path / "tiny.parquet", n)
    options = {"image_key": "img", "label_key": "digit", "cache_dir": str(tmp_path / "cache"), "workers": 0, **options}
    return DataConfig(source=str(tmp_path / "tiny.parquet"), **options), pixels


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def prepared(split: ImageTrainSplit | ImageEvalSplit) -> np.ndarray:
    return np.asarray(jax.jit(split.prepare)({"image": np.asarray(split.arrays.image)})["image"])


def test_a_split_is_stored_as_uint8_memory_mapped_with_its_scale_and_classes(tmp_path: Path):
    cfg, pixels = parquet_config(tmp_path)
    arrays = load_images(cfg, "train")
    assert isinstance(arrays.image, np.memmap) and arrays.image.dtype == np.uint8
    np.testing.assert_array_equal(arrays.image[..., 0], pixels)
    assert arrays.label.dtype == np.int32 and arrays.label.tolist() == [i % 3 for i in range(40)]
    assert (arrays.scale, arrays.num_classes) == (255.0, 3)
    assert arrays.path.parent == tmp_path / "cache"


def test_a_second_load_reads_the_cache_without_decoding(tmp_path: Path, monkeypatch):
    """The images are PNG files the dataset points to: once they are deleted, only the cache can answer."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(8, 4, 4), dtype=np.uint8)
    (tmp_path / "pngs").mkdir()
    for i, p in enumerate(pixels):
        Image.fromarray(p).save(tmp_path / "pngs" / f"{i}.png")
    (tmp_path / "png_files.py").write_text(
        textwrap.dedent(
            f"""
            import datasets
            def load(split):
                files = [{str(tmp_path / "pngs")!r} + f"/{{i}}.png" for i in range(8)]
                return datasets.Dataset.from_dict({{"image": files}}).cast_column("image", datasets.Image())
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(source="png_files:load", label_key=None, cache_dir=str(tmp_path / "cache"), workers=0)
    first = load_images(cfg, "train")
    for png in (tmp_path / "pngs").iterdir():
        png.unlink()
    second = load_images(cfg, "train")
    assert second.path == first.path and entries(tmp_path / "cache") == [first.path.name]
    np.testing.assert_array_equal(second.image[..., 0], pixels)


def test_a_warm_load_of_unchanged_local_files_opens_no_dataset_and_an_edit_is_decoded_again(tmp_path: Path):
    """The entry's own key needs the opened dataset's fingerprint (importing `datasets`, 0.7 s of a warm
    run); an alias from the local files' sizes and times finds it without."""
    cfg, pixels = parquet_config(tmp_path)
    first = load_images(cfg, "train")  # decodes, and records the alias
    probe = textwrap.dedent(
        f"""
        import sys
        from nnx_cli.config import DataConfig
        from nnx_cli.data.images import load_images
        arrays = load_images(DataConfig(**{vars(cfg)!r}), "train")
        print(arrays.path, arrays.image[..., 0].sum(), "datasets" in sys.modules)
        """
    )
    warm = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert warm == [str(first.path), str(pixels.sum()), "False"]

    edited = png_parquet(tmp_path / "tiny.parquet", 30)  # the same file written again, other images
    second = load_images(cfg, "train")
    assert second.path != first.path and len(entries(tmp_path / "cache")) == 2
    np.testing.assert_array_equal(second.image[..., 0], edited)


def test_another_split_column_or_source_makes_another_cache_entry(tmp_path: Path):
    import datasets

    train, _ = png_dataset(12, seed=1)
    test, _ = png_dataset(4, seed=2)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(source=str(tmp_path / "saved"), image_key="img", label_key="digit", cache_dir=str(tmp_path / "c"))
    paths = {
        load_images(cfg, "train").path,
        load_images(cfg, "test").path,
        load_images(DataConfig(**{**vars(cfg), "label_key": None}), "train").path,
    }
    other, _ = parquet_config(tmp_path, cache_dir=str(tmp_path / "c"))
    paths.add(load_images(other, "train").path)
    assert len(paths) == 4 and len(entries(tmp_path / "c")) == 4
    assert load_images(cfg, "test").image.shape == (4, 6, 5, 1)


def grey(pixels: np.ndarray, scale: float = 255.0) -> np.ndarray:
    """The float32 grey levels in [0, 1] that earlier releases decoded into memory: `pixels / scale`."""
    return (pixels / scale).astype(np.float32)[..., None]


def test_prepare_gives_float32_grey_levels_rounded_as_a_float64_division(tmp_path: Path):
    cfg, pixels = parquet_config(tmp_path, n=600)  # 18,000 pixels: every level 0..255 appears
    assert len(np.unique(load_images(cfg, "train").image)) == 256
    np.testing.assert_array_equal(prepared(image_train_split(cfg, seed=0)), grey(pixels))


def test_prepare_with_binarize_thresholds_the_grey_levels(tmp_path: Path):
    cfg, pixels = parquet_config(tmp_path, n=600, binarize=0.5)
    expected = (grey(pixels) > 0.5).astype(np.float32)
    assert set(np.unique(expected)) == {0.0, 1.0}
    np.testing.assert_array_equal(prepared(image_train_split(cfg, seed=0)), expected)


def test_16_bit_images_are_stored_as_uint16_and_scaled_by_65535(tmp_path: Path):
    pixels = png_parquet(tmp_path / "deep.parquet", 10, shape=(4, 4), dtype=np.uint16)
    cfg = DataConfig(source=str(tmp_path / "deep.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    arrays = load_images(cfg, "train")
    assert arrays.image.dtype == np.uint16 and arrays.scale == 65535.0
    np.testing.assert_array_equal(
        prepared(image_eval_split(DataConfig(**{**vars(cfg), "eval_split": "train"}))), grey(pixels, 65535.0)
    )


def test_palette_and_one_bit_pngs_are_stored_as_the_colours_and_levels_they_show(tmp_path: Path):
    """A palette PNG (pngquant's output, a converted GIF) was stored as its colour numbers, one grey channel."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    colours = np.array([[200, 30, 30], [20, 40, 220], [240, 240, 240]], np.uint8)
    rgb = colours[rng.integers(0, 3, size=(8, 4, 4))]
    palette = [Image.fromarray(p).quantize(colors=3, method=Image.Quantize.MEDIANCUT) for p in rgb]
    assert palette[0].mode == "P"
    bits = rng.integers(0, 2, size=(8, 4, 4)).astype(bool)
    for name, images, want in (
        ("palette", palette, rgb),
        ("bits", [Image.fromarray(b) for b in bits], bits[..., None] * np.uint8(255)),
    ):
        ds = datasets.Dataset.from_dict({"img": images}).cast_column("img", datasets.Image())
        ds.to_parquet(str(tmp_path / f"{name}.parquet"))
        cfg = DataConfig(source=str(tmp_path / f"{name}.parquet"), image_key="img", label_key=None,
                         cache_dir=str(tmp_path / "c"), workers=0)  # fmt: skip
        np.testing.assert_array_equal(load_images(cfg, "train").image, want)


def test_float_columns_are_stored_as_float32(tmp_path: Path):
    import datasets

    values = np.random.default_rng(0).random((5, 3, 3))
    datasets.Dataset.from_dict({"x": values.tolist()}).to_parquet(str(tmp_path / "floats.parquet"))
    cfg = DataConfig(source=str(tmp_path / "floats.parquet"), image_key="x", cache_dir=str(tmp_path / "c"), workers=0)
    arrays = load_images(cfg, "train")
    assert arrays.image.dtype == np.float32 and arrays.scale == 1.0
    np.testing.assert_array_equal(arrays.image[..., 0], values.astype(np.float32))


def test_a_float_column_outside_0_1_is_a_user_error_naming_its_values(tmp_path: Path):
    import datasets

    datasets.Dataset.from_dict({"x": np.full((4, 3, 3), 200.0).tolist()}).to_parquet(str(tmp_path / "f.parquet"))
    cfg = DataConfig(source=str(tmp_path / "f.parquet"), image_key="x", cache_dir=str(tmp_path / "c"), workers=0)
    with pytest.raises(UserError, match=r"'data.image_key': column 'x' holds float pixels from 200 to 200; .*\[0, 1\]"):
        load_images(cfg, "train")  # they were trained on unscaled, or made the loss NaN


def test_the_cache_is_the_same_whatever_the_number_of_workers(tmp_path: Path):
    pixels = png_parquet(tmp_path / "big.parquet", 1000, shape=(96, 96))  # 3 chunks of decoding work
    caches = []
    for workers in (0, 1, 3):
        cfg = DataConfig(source=str(tmp_path / "big.parquet"), image_key="img", cache_dir=str(tmp_path / f"c{workers}"))
        caches.append(load_images(DataConfig(**{**vars(cfg), "workers": workers}), "train"))
    for cache in caches[1:]:
        np.testing.assert_array_equal(cache.image, caches[0].image)
        np.testing.assert_array_equal(cache.label, caches[0].label)
    np.testing.assert_array_equal(caches[0].image[..., 0], pixels)


def test_workers_read_a_datasets_arrow_files_and_decode_one_built_in_memory_from_itself(tmp_path: Path):
    import datasets

    pixels = png_parquet(tmp_path / "big.parquet", 300, shape=(96, 96))
    on_disk = datasets.load_dataset("parquet", data_files=str(tmp_path / "big.parquet"), split="train",
                                    cache_dir=str(tmp_path / "hf"))  # fmt: skip
    in_memory, _ = png_dataset(300, shape=(96, 96))
    assert isinstance(_chunk_decoder(on_disk, "img", 128), ArrowImages)
    assert isinstance(_chunk_decoder(in_memory, "img", 128), DatasetImages)
    assert isinstance(_chunk_decoder(on_disk.select(range(10)), "img", 128), DatasetImages)  # rows of its own
    for ds in (on_disk, in_memory):
        chunks = list(decoded(_chunk_decoder(ds, "img", 128), 3, workers=2))
        np.testing.assert_array_equal(np.concatenate([c for c, _ in chunks]), pixels)


def test_images_of_several_shapes_are_a_user_error_and_leave_no_entry(tmp_path: Path):
    import datasets
    from PIL import Image

    images = [Image.fromarray(np.zeros((8 + i % 2, 8), np.uint8)) for i in range(4)]
    datasets.Dataset.from_dict({"img": images}).cast_column("img", datasets.Image()).to_parquet(
        str(tmp_path / "mixed.parquet")
    )
    cfg = DataConfig(source=str(tmp_path / "mixed.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    with pytest.raises(UserError, match=r"come in 2 shapes \(\(8, 8\), \(9, 8\), ...\); resize them to one shape"):
        load_images(cfg, "train")
    assert entries(tmp_path / "c") == []


def test_grey_and_colour_images_of_one_size_are_a_user_error_saying_to_convert_them(tmp_path: Path):
    """The error said to resize them: they have one size, and two modes."""
    import datasets
    from PIL import Image

    images = [Image.fromarray(np.zeros((8, 8, 3) if i % 2 else (8, 8), np.uint8)) for i in range(4)]
    ds = datasets.Dataset.from_dict({"img": images}).cast_column("img", datasets.Image())
    ds.to_parquet(str(tmp_path / "modes.parquet"))
    cfg = DataConfig(source=str(tmp_path / "modes.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    with pytest.raises(UserError, match=r"\(8, 8\), \(8, 8, 3\), ...\); convert them to one mode \(all RGB, or all"):
        load_images(cfg, "train")


def test_a_column_of_image_paths_is_a_user_error_saying_how_to_make_it_an_image_column(tmp_path: Path):
    """It said the column held '<U37 values of shape ()', not images."""
    import datasets

    ds = datasets.Dataset.from_dict({"img": [f"pics/{i}.png" for i in range(4)], "label": [0, 1, 0, 1]})
    ds.to_parquet(str(tmp_path / "paths.parquet"))
    cfg = DataConfig(source=str(tmp_path / "paths.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    with pytest.raises(UserError, match=r"column 'img' holds text \(file paths\?\), not decoded images; .*"
                                        r"ds.cast_column\('img', datasets.Image\(\)\)"):  # fmt: skip
        load_images(cfg, "train")


@pytest.mark.parametrize("workers", [0, 2])
def test_an_image_that_cannot_be_decoded_is_a_user_error_naming_its_row_and_file(tmp_path: Path, workers: int):
    """Decoded in the worker processes too: the error comes back as one line, not a PIL traceback (exit 1)."""
    from PIL import Image

    for i in range(6):
        (tmp_path / "photos" / "train" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((4, 4), i, np.uint8)).save(tmp_path / "photos" / "train" / f"c{i % 2}" / f"{i}.png")
    broken = tmp_path / "photos" / "train" / "c1" / "3.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    cfg = DataConfig(source=str(tmp_path / "photos"), cache_dir=str(tmp_path / "c"), workers=workers)
    with pytest.raises(UserError, match=r"the image of row \d of column 'image' \(.*3\.png\) cannot be decoded "
                                        r"\(UnidentifiedImageError: "):  # fmt: skip
        load_images(cfg, "train")
    assert entries(tmp_path / "c") == []


def test_a_row_without_an_image_is_a_user_error_naming_it(tmp_path: Path):
    import datasets

    ds, _ = png_dataset(4)
    ds = datasets.Dataset.from_dict({"img": [ds[0]["img"], None, ds[2]["img"]], "digit": [0, 1, 2]})
    ds.cast_column("img", datasets.Image()).save_to_disk(str(tmp_path / "nulls"))
    cfg = DataConfig(source=str(tmp_path / "nulls"), image_key="img", label_key="digit", cache_dir=str(tmp_path / "c"),
                     workers=0)  # fmt: skip
    with pytest.raises(UserError, match=r"^config key 'data.image_key': row 1 of column 'img' holds no image; "):
        load_images(cfg, "train")


@pytest.mark.parametrize(
    "labels, problem",
    [(["a", "b", "a"], "'a' in row 0"), ([0.0, 1.5, 2.0], "1.5 in row 1"), ([0.0, None, 1.0], "no label in row 1")],
    ids=["text", "fraction", "missing"],
)
def test_labels_that_are_not_class_indices_are_a_user_error_naming_a_row(tmp_path: Path, labels: list, problem: str):
    """Text labels were a traceback (int('a')), fractions were cut to integers and trained on silently."""
    import datasets

    ds, _ = png_dataset(3)
    datasets.Dataset.from_dict({"img": list(ds["img"]), "label": labels}).cast_column(
        "img", datasets.Image()
    ).to_parquet(str(tmp_path / "labels.parquet"))
    cfg = DataConfig(source=str(tmp_path / "labels.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    with pytest.raises(UserError, match=rf"^config key 'data.label_key': column 'label' has {problem}; labels are "):
        load_images(cfg, "train")


def test_an_entry_an_earlier_decoder_wrote_is_decoded_again(tmp_path: Path, monkeypatch):
    """Entries written before fractional labels were refused hold them cut to integers: read as they were, the
    refusal would never be seen by a user who had trained on that source before."""
    import datasets

    from nnx_cli.data import images

    ds, _ = png_dataset(3)
    datasets.Dataset.from_dict({"img": list(ds["img"]), "label": [0.0, 1.5, 2.0]}).cast_column(
        "img", datasets.Image()
    ).to_parquet(str(tmp_path / "labels.parquet"))
    cfg = DataConfig(source=str(tmp_path / "labels.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    with monkeypatch.context() as earlier:  # the decoder before: revision 1, fractions cut to integers
        earlier.setattr(images, "_DECODER", 1)
        earlier.setattr(images, "_class_indices", lambda values, key: np.asarray(values).astype(np.int32))
        assert load_images(cfg, "train").label.tolist() == [0, 1, 2]
        assert load_images(cfg, "train").label.tolist() == [0, 1, 2]  # through the alias too
    with pytest.raises(UserError, match=r"column 'label' has 1.5 in row 1"):
        load_images(cfg, "train")


def test_whole_float_labels_are_class_indices(tmp_path: Path):
    import datasets

    ds, _ = png_dataset(3)
    datasets.Dataset.from_dict({"img": list(ds["img"]), "label": [2.0, 0.0, 1.0]}).cast_column(
        "img", datasets.Image()
    ).to_parquet(str(tmp_path / "labels.parquet"))
    cfg = DataConfig(source=str(tmp_path / "labels.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    arrays = load_images(cfg, "train")
    assert arrays.label.tolist() == [2, 0, 1] and arrays.num_classes == 3


def test_todays_source_errors_are_kept(tmp_path: Path):
    cfg, _ = parquet_config(tmp_path)
    with pytest.raises(UserError, match="no split 'test'.*available: train.*data.eval_split=null"):
        load_images(cfg, "test", "data.eval_split")
    with pytest.raises(UserError, match="data.image_key.*'imgs'.*did you mean 'img'"):
        load_images(DataConfig(**{**vars(cfg), "image_key": "imgs"}), "train")
    with pytest.raises(UserError, match="data.source.*does not exist"):
        load_images(DataConfig(source=str(tmp_path / "missing")), "train")


def test_a_relative_directory_with_a_trailing_slash_that_does_not_exist_is_not_looked_up_on_the_hub(
    tmp_path: Path, monkeypatch
):
    """`source: my_imags/` (the images guide's form, mistyped) was tried as a Hub id: HFValidationError."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^config key 'data.source': local dataset 'my_imags/' does not exist$"):
        load_images(DataConfig(source="my_imags/"), "train")


def test_digits_is_a_registered_source_kept_in_memory_in_levels_0_to_16():
    arrays = load_images(DataConfig(), "train")
    assert "sklearn:digits" in SOURCES and arrays.path is None
    assert arrays.image.dtype == np.uint8 and arrays.image.max() == 16 and arrays.scale == 16.0
    from sklearn.datasets import load_digits

    np.testing.assert_array_equal(prepared(image_train_split(DataConfig(), 0)), grey(load_digits().images[:1500], 16.0))


def test_a_user_source_beside_the_config_needs_no_pythonpath(tmp_path: Path):
    """Run from the project directory by a script elsewhere, so only nnx_cli puts the directory on the path."""
    project, runner = tmp_path / "project", tmp_path / "runner"
    project.mkdir(), runner.mkdir()
    (project / "my_source.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            def load(split):
                n = {"train": 20, "test": 6}[split]
                return {"image": np.full((n, 4, 4), 200, np.uint8), "label": np.arange(n) % 4}
            """
        )
    )
    (runner / "run.py").write_text(
        textwrap.dedent(
            """
            from nnx_cli.config import DataConfig
            from nnx_cli.data.images import load_images
            arrays = load_images(DataConfig(source="my_source:load"), "test")
            print(arrays.image.shape, arrays.image.dtype, arrays.scale, arrays.num_classes)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(runner / "run.py")], cwd=project, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(6, 4, 4, 1) uint8 255.0 4"


def write_source(tmp_path: Path, name: str, body: str, monkeypatch) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    return f"{name}:load"


def test_a_user_source_without_the_split_is_a_user_error(tmp_path: Path, monkeypatch):
    source = write_source(tmp_path, "only_train", "def load(split):\n    return {'train': None}[split]\n", monkeypatch)
    with pytest.raises(UserError, match="data.eval_split.*'only_train:load' has no split 'test'"):
        load_images(DataConfig(source=source), "test", "data.eval_split")


def test_a_user_source_returning_something_else_is_a_user_error(tmp_path: Path, monkeypatch):
    source = write_source(tmp_path, "returns_list", "def load(split):\n    return [1, 2]\n", monkeypatch)
    with pytest.raises(UserError, match="returned a list; expected a datasets.Dataset, a mapping"):
        load_images(DataConfig(source=source), "train")


def test_a_user_source_mapping_is_read_by_data_image_key_and_label_key(tmp_path: Path, monkeypatch):
    """The mapping's keys had to be 'image' and 'label' whatever the config said: label_key was silently unread."""
    body = textwrap.dedent("""
        import numpy as np

        def load(split):
            return {"pixels": np.zeros((4, 3, 3), np.uint8), "y": np.arange(4)}
    """)
    source = write_source(tmp_path, "keyed", body, monkeypatch)
    arrays = load_images(DataConfig(source=source, image_key="pixels", label_key="y"), "train")
    assert arrays.image.shape == (4, 3, 3, 1) and arrays.label.tolist() == [0, 1, 2, 3]
    with pytest.raises(UserError, match=r"returned a dict with keys pixels, y; expected a datasets.Dataset, a "
                                        r"mapping with an 'image' array \(data.image_key"):  # fmt: skip
        load_images(DataConfig(source=source), "train")


def test_a_user_source_with_floats_outside_0_1_is_a_user_error(tmp_path: Path, monkeypatch):
    body = "import numpy as np\ndef load(split):\n    return {'image': np.full((3, 2, 2), 255.0)}\n"
    source = write_source(tmp_path, "float_pixels", body, monkeypatch)
    with pytest.raises(UserError, match=r"float images outside \[0, 1\]"):
        load_images(DataConfig(source=source), "train")


def test_a_user_source_that_raises_is_a_user_error_naming_it_and_the_split(tmp_path: Path, monkeypatch):
    source = write_source(tmp_path, "broken", "def load(split):\n    raise ValueError('no such folder: imgs/')\n",
                          monkeypatch)  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"^config key 'data.source': data source 'broken:load' raised ValueError: no "
        r"such folder: imgs/ for split 'train'",
    ):  # fmt: skip (the key was data.train_split)
        load_images(DataConfig(source=source), "train")


def test_each_epoch_is_a_permutation_from_seed_and_epoch():
    train = image_train_split(DataConfig(), seed=7)
    assert train.steps_per_epoch(100) == 15  # 1500 examples: the last partial batch is dropped
    for epoch in (0, 1, 5):
        keys = train.epoch_keys(epoch)
        np.testing.assert_array_equal(keys, np.random.default_rng((7, epoch)).permutation(1500))
    assert not np.array_equal(train.epoch_keys(0), train.epoch_keys(1))
    assert not np.array_equal(train.epoch_keys(0), image_train_split(DataConfig(), seed=8).epoch_keys(0))


def test_a_batch_larger_than_the_split_is_a_user_error():
    split = ImageTrainSplit(ImageArrays(np.zeros((5, 2, 2, 1), np.uint8), None, 255.0, None), seed=0)
    with pytest.raises(UserError, match=r"train.batch_size' \(8\) is larger than the training split \(5"):
        split.steps_per_epoch(8)


def test_rows_of_a_page_or_more_are_read_from_the_cache_file_as_they_are_mapped(tmp_path: Path):
    png_parquet(tmp_path / "wide.parquet", 30, shape=(64, 64))  # 4096-byte rows: read with pread
    cfg = DataConfig(source=str(tmp_path / "wide.parquet"), image_key="img", cache_dir=str(tmp_path / "c"), workers=0)
    train = image_train_split(cfg, seed=0)
    keys = train.epoch_keys(1)[:17]
    np.testing.assert_array_equal(train.read(keys)["image"], np.asarray(train.arrays.image)[keys])


def test_read_on_device_gathers_the_rows_read_on_the_host():
    train = image_train_split(DataConfig(), seed=0)
    keys = train.epoch_keys(3)[:64]
    on_device = jax.jit(train.read_on_device)(jax.device_put(train.stored()), keys.astype(np.int32))
    for name, rows in train.read(keys).items():
        np.testing.assert_array_equal(np.asarray(on_device[name]), rows)


def test_eval_batches_cover_the_split_once_in_stored_form_with_a_mask():
    split = image_eval_split(DataConfig())
    batches = list(split.eval_batches(128))
    assert [len(b["image"]) for b in batches] == [128, 128, 128] and batches[0]["image"].dtype == np.uint8
    np.testing.assert_array_equal(np.concatenate([b["image"][b["mask"]] for b in batches]), split.arrays.image)
    assert np.concatenate([b["label"][b["mask"]] for b in batches]).tolist() == split.arrays.label.tolist()


SPLITS = """
import numpy as np

def load(split):
    size = {{"train": 4, "test": 5}}[split] if "{shapes}" == "differ" else 4
    classes = 7 if split == "test" and "{shapes}" == "eval_wider" else {classes}
    labels = np.arange(40) % classes - ("{shapes}" == "negative")
    return {{"image": np.zeros((40, size, 4), np.uint8), "label": labels}}
"""


@pytest.mark.parametrize(
    "shapes, classes, overrides, message",
    [
        ("differ", 2, [], r"'data.eval_split': its examples are \[5, 4, 1\], the training split's \[4, 4, 1\]"),
        ("same", 3, ["model.num_classes=2"], r"'model.num_classes' is 2, but the training split's labels run from 0 "
                                             r"to 2; .*set model.num_classes=3"),
        ("negative", 3, [], r"^config key 'data.label_key': the training split has the label -1; labels are class "
                            r"indices, 0 to num_classes - 1: renumber them from 0$"),
        ("eval_wider", 3, [], r"'model.num_classes' is 3, but the eval split 'test''s labels run from 0 to 6; .*"
                              r"set model.num_classes=7"),
    ],
)  # fmt: skip
def test_data_a_classifier_cannot_train_on_is_refused_before_it_starts(tmp_path, monkeypatch, shapes, classes,
                                                                      overrides, message):  # fmt: skip
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup

    body = SPLITS.replace("{shapes}", shapes).format(classes=classes)
    source = write_source(tmp_path, f"splits_{shapes}", body, monkeypatch)  # a module name per case: imports cache
    options = ["model={name: mlp_classifier, hidden_sizes: [8]}", f"data.source={source}", *overrides]
    with pytest.raises(UserError, match=message):  # the first eval crashed, or the loss was NaN at step 1
        setup(load_config(None, options), data="train")
