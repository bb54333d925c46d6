"""Flip: the device weights arena, its host slab, and the rotation that swaps their images.

    image.py     manifests (named tensors at 256-byte offsets) and their chunk checksums
    readers.py   what holds views of the arena; rebound all or none on every generation
    arena.py     the device buffer, its image and generation (load, adopt, refit)
    slab.py      the pinned host buffer: one image plus the overshoot a rotation needs
    plan.py      the rotation's arithmetic, pure (order, offsets, hazards, refusals)
    copies.py    the two copy directions: CUDA streams and events, or synchronous on a CPU
    rotation.py  the executor: runs a plan, verifies both images, rebinds the readers
    model_image.py  a served model's weights as an image; the model runner as a reader of the arena

The serving worker uses them through dataplane/weights_models.py (the models it was started
with) and dataplane/weights_swap.py (SwapWeights: flip, sleep, wake).
"""
