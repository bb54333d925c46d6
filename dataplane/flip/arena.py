"""The device weights arena: one buffer that holds one weights image at a time, at offset 0.

Sized once for the largest image it may hold; what changes is which image its bytes are
(``image``) and its generation (``gen``). Readers (readers.py) hold views of the buffer and carry
the generation they were bound at; every install of an image — a load, a flip, a refit — is a new
generation, and the readers move to it all or none.

    buffer |<------------ image (manifest.nbytes) ------------>|  unused  |
           0                                                             capacity_bytes

A refit (new bytes of the same layout, e.g. a trainer's weight update) keeps the views: the
readers are stamped with the new generation once the new bytes verified.
``release`` gives the buffer's memory back (a sleep) and ``reserve`` takes it again (a wake).
Every install may name its generation (``gen``: the control's ``to_gen``); it must move forward.
On a CPU-only host the buffer is RAM, with the same semantics.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from residency.dataplane.flip.errors import FlipRefused, ReaderRefused
from residency.dataplane.flip.image import DEFAULT_CHUNK_BYTES, Image, Manifest, image_checksums, mismatched_chunks
from residency.dataplane.flip.readers import WeightsReader, rebind_all
from residency.dataplane.flip.slab import HostSlab
from residency.dataplane.pools.errors import ChecksumMismatch, IntegrityError


class WeightsArena:
    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.capacity_bytes = int(capacity_bytes)
        self.buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        self.image: Image | None = None
        self.gen = 0
        self.num_installs = 0
        self.readers: list[WeightsReader] = []

    @property
    def held_bytes(self) -> int:
        """Device bytes the buffer holds now (0 after ``release``)."""
        return self.buffer.numel()

    @classmethod
    def sized_for(cls, manifests: Iterable[Manifest], device: str | torch.device = "cpu") -> "WeightsArena":
        return cls(max(m.nbytes for m in manifests), device)

    # ------------------------------------------------------------ queries
    def image_bytes(self) -> torch.Tensor:
        if self.image is None:
            raise IntegrityError("the arena holds no image")
        return self.buffer[: self.image.nbytes]

    def views(self) -> dict[str, torch.Tensor]:
        if self.image is None:
            raise IntegrityError("the arena holds no image")
        return self.image.manifest.views(self.buffer)

    def fit_refusal(self, manifest: Manifest) -> FlipRefused | None:
        if manifest.nbytes > self.capacity_bytes:
            return FlipRefused("image larger than the arena", manifest.nbytes, self.capacity_bytes)
        return None

    def verify(self) -> None:
        """Raise ChecksumMismatch naming the chunks whose bytes are not the image's."""
        if self.image is None:
            raise IntegrityError("the arena holds no image to verify")
        if self.image.sums is None:
            raise IntegrityError(f"arena image {self.image.model} was never checksummed: nothing to verify against")
        got = image_checksums(self.image_bytes(), self.image.sums.chunk_bytes)
        bad = mismatched_chunks(self.image.sums, got)
        if bad:
            raise ChecksumMismatch(f"arena image {self.image.model}", bad)

    def check_integrity(self) -> None:
        if self.image is not None and self.image.nbytes > self.capacity_bytes:
            raise IntegrityError(f"arena image of {self.image.nbytes} bytes over capacity {self.capacity_bytes}")
        behind = {r.name: r.gen for r in self.readers if r.gen != self.gen}
        if self.image is not None and behind:
            raise IntegrityError(f"arena at gen {self.gen} has readers at other generations: {behind}")
        if self.image is None and any(r.gen is not None for r in self.readers):
            raise IntegrityError("arena holds no image but readers are still bound: "
                                 f"{ {r.name: r.gen for r in self.readers} }")

    # ------------------------------------------------------------ generations
    def check_readers(self, readers: Sequence[WeightsReader], manifest: Manifest) -> None:
        """ReaderRefused if any of ``readers`` cannot use ``manifest``. Pure; call before moving bytes."""
        refusals = {r.name: why for r in readers if (why := r.refusal(manifest)) is not None}
        if refusals:
            raise ReaderRefused(self.gen + 1, refusals)

    def detach(self) -> None:
        """Unbind every reader: the bytes are about to change under them. The image is forgotten
        too (its bytes stop being what its checksums say), and a later ``install`` names the new one."""
        for r in self.readers:
            r.unbind()
        self.readers = []
        self.image = None

    def seal(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Image:
        """Checksum the image's bytes if that was never done (its bytes are what was written; the
        readers and the generation stay). Returns the image, with its sums."""
        if self.image is None:
            raise IntegrityError("the arena holds no image to checksum")
        if self.image.sums is None:
            self.image = Image(self.image.model, self.image.manifest,
                               image_checksums(self.image_bytes(), chunk_bytes))
        return self.image

    def gen_refusal(self, gen: int | None) -> str | None:
        """Why an install at ``gen`` would not move forward (the first install may take gen 0)."""
        if gen is not None and (gen < self.gen if self.num_installs == 0 else gen <= self.gen):
            return f"to_gen {gen} does not move forward from the arena's gen {self.gen}"
        return None

    def release(self, gen: int | None = None) -> int:
        """Give the buffer's device memory back (a sleep): every reader unbound, the image
        forgotten, the generation moved to ``gen`` (else one on). Returns the bytes let go; a
        later ``reserve`` allocates the same capacity again."""
        self.detach()
        freed = self.held_bytes
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.gen = gen if gen is not None else self.gen + 1
        return freed

    def reserve(self) -> int:
        """Allocate the buffer again after ``release``; returns the bytes taken (0: it was held)."""
        if self.held_bytes == self.capacity_bytes:
            return 0
        self.buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        return self.capacity_bytes

    def add_reader(self, reader: WeightsReader) -> None:
        """A reader made after the image was installed: bound now at the current generation
        (ReaderRefused: not added)."""
        if self.image is None:
            raise IntegrityError(f"reader {reader.name}: the arena holds no image to bind to")
        rebind_all([reader], self.image.manifest, self.views(), self.gen)
        self.readers.append(reader)

    def install(self, image: Image, readers: Sequence[WeightsReader], gen: int | None = None) -> dict[str, int]:
        """The buffer's bytes are ``image`` (verified by the caller): a new generation (``gen``,
        else one on), every reader bound to it or none (ReaderRefused; the arena then holds the
        image with no readers)."""
        if (why := self.gen_refusal(gen)) is not None:
            raise IntegrityError(why)
        self.image = image
        self.gen = gen if gen is not None else self.gen + 1
        self.num_installs += 1
        stamps = rebind_all(list(readers), image.manifest, image.manifest.views(self.buffer), self.gen)
        self.readers = list(readers)
        return stamps

    # ------------------------------------------------------------ filling
    def adopt(self, model: str, manifest: Manifest, readers: Sequence[WeightsReader] = (),
              chunk_bytes: int | None = DEFAULT_CHUNK_BYTES, gen: int | None = None) -> Image:
        """The bytes already at the start of the buffer are ``model`` laid out as ``manifest``
        (written there in place, e.g. generated on the device): checksum them (``chunk_bytes``
        None: later, see ``seal``) and install them."""
        if (r := self.fit_refusal(manifest)) is not None:
            raise r
        self.check_readers(readers, manifest)
        sums = image_checksums(self.buffer[: manifest.nbytes], chunk_bytes) if chunk_bytes else None
        image = Image(model, manifest, sums)
        self.install(image, readers, gen)
        return image

    def load(self, slab: HostSlab, readers: Sequence[WeightsReader] = (), gen: int | None = None) -> dict[str, int]:
        """Copy the slab's image into the arena (the slab keeps its copy) and install it. The host
        image is verified first: a mismatch, a manifest over capacity or a reader that refuses
        raises before a byte moves. Returns the readers' stamps."""
        if slab.image is None:
            raise IntegrityError("the slab holds no image to load")
        if (r := self.fit_refusal(slab.image.manifest)) is not None:
            raise r
        self.check_readers(readers, slab.image.manifest)
        if (why := self.gen_refusal(gen)) is not None:
            raise IntegrityError(why)
        slab.verify()
        self.copy_in(slab.image, slab.image_bytes())
        return self.install(slab.image, readers, gen)

    def refit(self, source: HostSlab | Mapping[str, torch.Tensor], chunk_bytes: int | None = None,
              gen: int | None = None) -> dict[str, int]:
        """New bytes for the same layout (an RL trainer's update): the same views, a new generation
        stamped on every current reader. ``source``: a slab (verified first) or tensors by name."""
        if self.image is None:
            raise IntegrityError("refit needs an installed image")
        manifest = self.image.manifest
        readers = list(self.readers)
        if (why := self.gen_refusal(gen)) is not None:
            raise IntegrityError(why)
        if isinstance(source, HostSlab):
            if source.image is None or source.image.manifest != manifest:
                raise ReaderRefused(self.gen + 1, {r.name: "refit image has another layout" for r in readers}
                                    or {"arena": "refit image has another layout"})
            source.verify()
            image = Image(self.image.model, manifest, source.image.sums)
            self.detach()
            self.copy_in(image, source.image_bytes())
        else:
            staged = torch.zeros(manifest.nbytes, dtype=torch.uint8, device=self.device)
            manifest.pack(source, staged)      # refuses tensors that do not match, before anything moves
            model = self.image.model
            chunk = chunk_bytes or (self.image.sums.chunk_bytes if self.image.sums else DEFAULT_CHUNK_BYTES)
            self.detach()
            self.buffer[: manifest.nbytes].copy_(staged)
            image = Image(model, manifest, image_checksums(self.buffer[: manifest.nbytes], chunk))
        return self.install(image, readers, gen)

    def copy_in(self, image: Image, src: torch.Tensor) -> None:
        """Copy ``src`` (the image's bytes, any device) into the buffer and verify it: ChecksumMismatch
        leaves the arena with no image. Installs nothing (see ``install``)."""
        self.buffer[: image.nbytes].copy_(src, non_blocking=False)
        self.image = image
        try:
            self.verify()
        except ChecksumMismatch:
            self.image = None
            raise
