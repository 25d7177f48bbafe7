"""LoRA fine-tuning of a FLUX.1 / FLUX.2 / klein / Qwen-Image / FLUX.3 / Qwen-Image 2.1 transformer on an
image-caption folder, fully sharded: the script form of ``python -m functional_dit train``
(`functional_dit.train`, where the trainer lives; docs/training.md).

    torchrun --nproc-per-node 2 examples/train_lora.py --data my_images --output-dir run \\
        --fsdp 2 --steps 500 --checkpoint-every 100            # add --resume to continue
    python examples/train_lora.py --data my_images --output-dir run --pipeline /path/to/FLUX.1-dev
"""

import sys

from functional_dit.train import main, parser  # noqa: F401  (parser: the options, for --help)

if __name__ == "__main__":
    main(sys.argv[1:])
