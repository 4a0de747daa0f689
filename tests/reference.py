"""An independent NumPy reference of the NVFP4 recipe, written from the numeric contract.

Element rounding uses explicit interval tests (as the recipe's reference quantizer does), not
a dtype conversion, so it shares no code path with the library.
"""

import ml_dtypes
import numpy as np

F32 = np.float32
F32_MAX = np.finfo(np.float32).max


def _e2m1_code(x):
    x = np.asarray(x, np.float32)
    r = np.zeros(x.shape, np.uint8)
    r[(x > 0.25) & (x < 0.75)] = 1
    r[(x >= 0.75) & (x <= 1.25)] = 2
    r[(x > 1.25) & (x < 1.75)] = 3
    r[(x >= 1.75) & (x <= 2.5)] = 4
    r[(x > 2.5) & (x < 3.5)] = 5
    r[(x >= 3.5) & (x <= 5.0)] = 6
    r[x > 5.0] = 7
    r[(x >= -0.25) & (x < -0.0)] = 8
    r[(x < -0.25) & (x > -0.75)] = 9
    r[(x <= -0.75) & (x >= -1.25)] = 10
    r[(x < -1.25) & (x > -1.75)] = 11
    r[(x <= -1.75) & (x >= -2.5)] = 12
    r[(x < -2.5) & (x > -3.5)] = 13
    r[(x <= -3.5) & (x >= -5.0)] = 14
    r[x < -5.0] = 15
    return r


E2M1_MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _e2m1_code_stochastic(v, uniform):
    """Stochastic rounding of clamped float32 values: the magnitude goes to its upper E2M1
    neighbour when ``uniform < (|v| - lower) / (upper - lower)`` (float32), else to the lower."""
    v = np.asarray(v, np.float32)
    a = np.abs(v)
    lo_idx = np.searchsorted(E2M1_MAGNITUDES, a, side="right") - 1  # largest magnitude <= |v|
    hi_idx = np.minimum(lo_idx + 1, 7)
    lo, hi = E2M1_MAGNITUDES[lo_idx], E2M1_MAGNITUDES[hi_idx]
    gap = (hi - lo).astype(np.float32)
    with np.errstate(all="ignore"):
        p = np.where(gap > 0, ((a - lo).astype(np.float32) / np.where(gap > 0, gap, F32(1))).astype(np.float32), F32(0))
    mag = np.where(np.asarray(uniform, np.float32) < p, hi_idx, lo_idx).astype(np.uint8)
    return mag | ((v < 0).astype(np.uint8) << 3)


def _hash32(x):
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def uniform_from_index(seeds, index):
    """The recipe's counter-based draw, transcribed in NumPy: uniform [0, 1) float32 from the
    two uint32 ``seeds`` of a key (``jax.random.bits(key, (2,), uint32)``) and each element's
    uint32 flat index in the logical tensor."""
    s0, s1 = (np.uint32(v) for v in np.asarray(seeds, np.uint32))
    with np.errstate(over="ignore"):
        h = _hash32(np.asarray(index, np.uint32) * np.uint32(0x9E3779B9) + s0)
        h = _hash32(h ^ s1)
    return (h >> np.uint32(8)).astype(np.float32) * F32(2.0**-24)


def stochastic_uniform(seeds, shape):
    """The draws of a stochastically rounded ``[rows, cols]`` matrix: element (r, c) draws by
    its flat index ``r * cols + c``."""
    rows, cols = shape
    index = (np.arange(rows, dtype=np.uint32)[:, None] * np.uint32(cols) + np.arange(cols, dtype=np.uint32)[None, :])
    return uniform_from_index(seeds, index)


def quantize_matrix(x, block=(16, 16), amax=None, uniform=None, four_over_six=False):
    """Reference quantization of one 2D matrix: (data u8 [r, ceil(c/2)], scale u8, amax f32).

    ``uniform``: ``[r, c]`` draws in [0, 1) for stochastic rounding (default: nearest-even).
    ``four_over_six``: each block keeps the scale (its amax to 6, or to 4:
    ``e4m3(clip(bam * (S * 0.25)))``) whose round-to-nearest values have the smaller sum of
    squared errors (float64 sums here; a tie keeps the 6)."""
    x = np.asarray(x).astype(np.float32)
    rows, cols = x.shape
    br, bc = block
    rp, cp = -(-rows // br) * br, -(-cols // bc) * bc
    xp = np.zeros((rp, cp), np.float32)
    xp[:rows, :cols] = x
    with np.errstate(all="ignore"):
        if amax is None:
            amax = np.max(np.abs(x)).astype(np.float32)
        amax = F32(amax)
        S = np.minimum(F32(448.0) * F32(6.0) / amax, F32_MAX).astype(np.float32)
        if S == 0:
            S = F32(1.0)
        D = F32(1.0) / S
        mult = S * (F32(1.0) / F32(6.0))
        tiles = xp.reshape(rp // br, br, cp // bc, bc)
        bam = np.abs(tiles).max(axis=(1, 3)).astype(np.float32)
        s = np.clip(np.minimum(bam * mult, F32_MAX), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        if four_over_six:
            s4 = np.clip(np.minimum(bam * (S * F32(0.25)), F32_MAX), -448, 448).astype(ml_dtypes.float8_e4m3fn)
            s = np.where(_block_sse(tiles, s4, D) < _block_sse(tiles, s, D), s4, s)
        e = np.minimum(F32(1.0) / (s.astype(np.float32) * D), F32_MAX).astype(np.float32)
        v = np.clip(tiles * e[:, None, :, None], -6, 6).astype(np.float32).reshape(rp, cp)
    if uniform is None:
        codes = _e2m1_code(v)[:rows, :cols]
    else:
        codes = _e2m1_code_stochastic(v[:rows, :cols], uniform)
    if cols % 2:  # the last byte's high nibble: code 0
        codes = np.pad(codes, ((0, 0), (0, 1)))
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return data, s.view(np.uint8), amax


def _block_sse(tiles, s, D):
    """Per block, the float64 sum of squared errors of ``tiles`` rounded to nearest with E4M3 scales ``s``."""
    sf = s.astype(np.float32)
    e = np.minimum(F32(1.0) / (sf * D), F32_MAX).astype(np.float32)
    v = np.clip(tiles * e[:, None, :, None], -6, 6).astype(np.float32)
    back = (E2M1[_e2m1_code(v)] * sf[:, None, :, None]).astype(np.float32) * D
    return np.sum((back.astype(np.float64) - tiles) ** 2, axis=(1, 3))


def quantize(x, block=(16, 16)):
    x = np.asarray(x)
    lead = x.shape[:-2]
    flat = x.reshape(-1, *x.shape[-2:])
    outs = [quantize_matrix(m, block) for m in flat]
    data = np.stack([o[0] for o in outs]).reshape(*lead, *outs[0][0].shape)
    scale = np.stack([o[1] for o in outs]).reshape(*lead, *outs[0][1].shape)
    amax = np.array([o[2] for o in outs], np.float32).reshape(lead)
    return data, scale, amax


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def dequantize_matrix(data, scale_u8, amax, shape, block=(16, 16)):
    rows, cols = shape
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(rows, -1)[:, :cols]
    vals = E2M1[codes]
    s = scale_u8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:rows, :cols]
    S = np.minimum(F32(2688.0) / F32(amax), F32_MAX)
    S = F32(1.0) if S == 0 else S
    return (vals * s) * (F32(1.0) / S)


def rht(a, signs):
    """The random Hadamard transform of NVFP4.md: rows of ``a`` [rows, cols] times
    ``diag(signs) @ H16 / 4`` in groups of 16 columns, in float64 (H16 the Sylvester matrix)."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    m = np.asarray(signs, np.float64)[:, None] * h / 4.0
    r, c = a.shape
    return (np.asarray(a, np.float64).reshape(r, c // 16, 16) @ m).reshape(r, c)
