//! A minimal PNG reader for tests (8-bit RGB/RGBA, not interlaced, as headless Chromium
//! writes screenshots): chunk walk, zlib inflate (RFC 1950/1951), scanline unfiltering.

/// Pixels as RGB triples, row-major.
pub struct Image {
    pub width: usize,
    pub height: usize,
    pub rgb: Vec<[u8; 3]>,
}

struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
    buf: u64,
    n: u32,
}

impl Bits<'_> {
    fn take(&mut self, count: u32) -> Result<u32, String> {
        while self.n < count {
            let byte = *self.data.get(self.pos).ok_or("deflate stream ends early")?;
            self.buf |= (byte as u64) << self.n;
            self.pos += 1;
            self.n += 8;
        }
        let v = (self.buf & ((1u64 << count) - 1)) as u32;
        self.buf >>= count;
        self.n -= count;
        Ok(v)
    }
}

/// Canonical Huffman code: codes per length and symbols in code order.
struct Huffman {
    counts: [u16; 16],
    symbols: Vec<u16>,
}

impl Huffman {
    fn new(lengths: &[u8]) -> Self {
        let mut counts = [0u16; 16];
        for &l in lengths {
            counts[l as usize] += 1;
        }
        counts[0] = 0;
        let mut offsets = [0u16; 16];
        for l in 1..15 {
            offsets[l + 1] = offsets[l] + counts[l];
        }
        let mut symbols = vec![0u16; lengths.len()];
        for (s, &l) in lengths.iter().enumerate() {
            if l != 0 {
                symbols[offsets[l as usize] as usize] = s as u16;
                offsets[l as usize] += 1;
            }
        }
        Self { counts, symbols }
    }

    fn decode(&self, bits: &mut Bits) -> Result<u16, String> {
        // Codes of each length are consecutive; walk the lengths one bit at a time.
        let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
        for len in 1..16 {
            code |= bits.take(1)? as i32;
            let count = self.counts[len] as i32;
            if code - first < count {
                return Ok(self.symbols[(index + code - first) as usize]);
            }
            index += count;
            first = (first + count) << 1;
            code <<= 1;
        }
        Err("invalid Huffman code".into())
    }
}

const LEN_BASE: [u16; 29] =
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258];
const LEN_EXTRA: [u8; 29] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];
const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145,
    8193, 12289, 16385, 24577,
];
const DIST_EXTRA: [u8; 30] =
    [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13];

fn inflate_block(bits: &mut Bits, out: &mut Vec<u8>, lit: &Huffman, dist: &Huffman) -> Result<(), String> {
    loop {
        let sym = lit.decode(bits)? as usize;
        match sym {
            0..=255 => out.push(sym as u8),
            256 => return Ok(()),
            _ => {
                let i = sym - 257;
                if i >= 29 {
                    return Err("invalid length symbol".into());
                }
                let len = LEN_BASE[i] as usize + bits.take(LEN_EXTRA[i] as u32)? as usize;
                let d = dist.decode(bits)? as usize;
                if d >= 30 {
                    return Err("invalid distance symbol".into());
                }
                let back = DIST_BASE[d] as usize + bits.take(DIST_EXTRA[d] as u32)? as usize;
                if back > out.len() {
                    return Err("distance before the start of the output".into());
                }
                let start = out.len() - back;
                for k in 0..len {
                    out.push(out[start + k]);
                }
            }
        }
    }
}

/// Decompresses a zlib stream (the Adler-32 trailer is not checked).
pub fn zlib_inflate(data: &[u8]) -> Result<Vec<u8>, String> {
    if data.len() < 2 || data[0] & 0x0f != 8 || (u16::from(data[0]) << 8 | u16::from(data[1])) % 31 != 0 {
        return Err("not a zlib stream".into());
    }
    let mut bits = Bits { data: &data[2..], pos: 0, buf: 0, n: 0 };
    let mut out = Vec::new();
    loop {
        let last = bits.take(1)?;
        match bits.take(2)? {
            0 => {
                bits.buf = 0;
                bits.n = 0;
                let d = bits.data;
                let p = bits.pos;
                let len = u16::from_le_bytes([*d.get(p).ok_or("short")?, *d.get(p + 1).ok_or("short")?]) as usize;
                let block = d.get(p + 4..p + 4 + len).ok_or("stored block past the end")?;
                out.extend_from_slice(block);
                bits.pos = p + 4 + len;
            }
            1 => {
                let mut l = [0u8; 288];
                l[..144].fill(8);
                l[144..256].fill(9);
                l[256..280].fill(7);
                l[280..].fill(8);
                inflate_block(&mut bits, &mut out, &Huffman::new(&l), &Huffman::new(&[5; 30]))?;
            }
            2 => {
                let hlit = bits.take(5)? as usize + 257;
                let hdist = bits.take(5)? as usize + 1;
                let hclen = bits.take(4)? as usize + 4;
                const ORDER: [usize; 19] = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15];
                let mut cl = [0u8; 19];
                for &o in &ORDER[..hclen] {
                    cl[o] = bits.take(3)? as u8;
                }
                let clh = Huffman::new(&cl);
                let mut lengths = Vec::with_capacity(hlit + hdist);
                while lengths.len() < hlit + hdist {
                    match clh.decode(&mut bits)? {
                        s @ 0..=15 => lengths.push(s as u8),
                        16 => {
                            let prev = *lengths.last().ok_or("repeat with no previous length")?;
                            let n = 3 + bits.take(2)?;
                            lengths.extend(std::iter::repeat_n(prev, n as usize));
                        }
                        17 => {
                            let n = 3 + bits.take(3)?;
                            lengths.extend(std::iter::repeat_n(0, n as usize));
                        }
                        _ => {
                            let n = 11 + bits.take(7)?;
                            lengths.extend(std::iter::repeat_n(0, n as usize));
                        }
                    }
                }
                if lengths.len() != hlit + hdist {
                    return Err("code lengths overflow".into());
                }
                let (lit, dist) = lengths.split_at(hlit);
                inflate_block(&mut bits, &mut out, &Huffman::new(lit), &Huffman::new(dist))?;
            }
            _ => return Err("invalid block type".into()),
        }
        if last == 1 {
            return Ok(out);
        }
    }
}

fn paeth(a: u8, b: u8, c: u8) -> u8 {
    let p = a as i16 + b as i16 - c as i16;
    let (pa, pb, pc) = ((p - a as i16).abs(), (p - b as i16).abs(), (p - c as i16).abs());
    if pa <= pb && pa <= pc {
        a
    } else if pb <= pc {
        b
    } else {
        c
    }
}

/// Decodes an 8-bit RGB or RGBA, non-interlaced PNG.
pub fn decode(bytes: &[u8]) -> Result<Image, String> {
    if bytes.get(..8) != Some(&[0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a][..]) {
        return Err("not a PNG".into());
    }
    let (mut pos, mut idat, mut header) = (8, Vec::new(), None);
    while pos + 8 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        let kind = &bytes[pos + 4..pos + 8];
        let data = bytes.get(pos + 8..pos + 8 + len).ok_or("chunk past the end")?;
        match kind {
            b"IHDR" => header = Some(data.to_vec()),
            b"IDAT" => idat.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        pos += 12 + len;
    }
    let h = header.ok_or("no IHDR")?;
    let width = u32::from_be_bytes(h[0..4].try_into().unwrap()) as usize;
    let height = u32::from_be_bytes(h[4..8].try_into().unwrap()) as usize;
    let channels = match (h[8], h[9], h[12]) {
        (8, 2, 0) => 3,
        (8, 6, 0) => 4,
        other => return Err(format!("unsupported PNG (bit depth, colour type, interlace) = {other:?}")),
    };
    let raw = zlib_inflate(&idat)?;
    let stride = width * channels;
    if raw.len() < height * (stride + 1) {
        return Err(format!("{} bytes of pixel data for {width}x{height}", raw.len()));
    }
    let mut px = vec![0u8; height * stride];
    for y in 0..height {
        let filter = raw[y * (stride + 1)];
        let src = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
        for x in 0..stride {
            let a = if x >= channels { px[y * stride + x - channels] } else { 0 };
            let b = if y > 0 { px[(y - 1) * stride + x] } else { 0 };
            let c = if x >= channels && y > 0 { px[(y - 1) * stride + x - channels] } else { 0 };
            let pred = match filter {
                0 => 0,
                1 => a,
                2 => b,
                3 => ((a as u16 + b as u16) / 2) as u8,
                4 => paeth(a, b, c),
                f => return Err(format!("invalid filter {f} on row {y}")),
            };
            px[y * stride + x] = src[x].wrapping_add(pred);
        }
    }
    let rgb = px.chunks_exact(channels).map(|p| [p[0], p[1], p[2]]).collect();
    Ok(Image { width, height, rgb })
}
