"""Checks that a PNG the tool wrote is a real, non-blank image of sensible size."""

from __future__ import annotations

import numpy as np
from PIL import Image


def assert_png(path, min_px=(500, 300), max_px=(3000, 3000)):
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.verify()
    with Image.open(path) as im:
        w, h = im.size
        assert min_px[0] <= w <= max_px[0] and min_px[1] <= h <= max_px[1], (w, h)
        assert np.asarray(im.convert("L")).std() > 5  # not a blank canvas
