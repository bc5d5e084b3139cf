"""Write real example images (Fashion-MNIST test set) to disk, e.g. for `curl` against the demo service.

    python -m training.examples --out runs/demo/example.png [--index 0] [--size 112]
    python -m training.examples --folder runs/demo/unlabelled --count 500   # for the labelling tab

A folder's file names carry no class (``00042.png``): the labelling tab is for images whose classes nobody wrote
down yet.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from training.data import FashionMNIST


def fashion_mnist_example(index: int = 0, size: int | None = None) -> tuple[Image.Image, str]:
    """Test image ``index`` as a PIL image (optionally upscaled) and its class name."""
    dataset = FashionMNIST(split="test")
    image, label, _ = dataset[index]
    picture = Image.fromarray(image.permute(1, 2, 0).numpy())
    if size:
        picture = picture.resize((size, size), Image.Resampling.BICUBIC)
    return picture, dataset.classes[label]


def write_folder(folder: Path, count: int) -> None:
    """The first ``count`` test images as ``folder/00000.png`` ... (written once; existing files are kept)."""
    dataset = FashionMNIST(split="test")
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(min(count, len(dataset))):
        path = folder / f"{i:05d}.png"
        if not path.exists():
            Image.fromarray(dataset.images[i]).save(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--size", type=int, default=None, help="upscale to SIZE x SIZE pixels")
    parser.add_argument("--folder", type=Path, help="write --count unlabelled test images into this folder")
    parser.add_argument("--count", type=int, default=500)
    args = parser.parse_args(argv)
    if args.folder is not None:
        write_folder(args.folder, args.count)
        print(f"wrote {args.count} unlabelled Fashion-MNIST test images to {args.folder}")
    if args.out is None:
        return
    picture, name = fashion_mnist_example(args.index, args.size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    picture.save(args.out)
    print(f"wrote {args.out} (Fashion-MNIST test image {args.index}: {name})")


if __name__ == "__main__":
    main()
