//! Transparent huge pages for the CPU backend's repacked weights. A decode token streams every
//! weight once; with 4 KiB pages a 200 MB matrix is 50,000 TLB misses and as many restarts of
//! the hardware prefetchers, and streaming reads run at ~22 GB/s on 2 cores of an Intel Xeon
//! where 2 MiB pages give ~29 GB/s. Linux backs an anonymous region with 2 MiB pages when asked
//! with `madvise(MADV_HUGEPAGE)` before its pages are first touched (the common
//! `transparent_hugepage=madvise` setting asks for exactly that), and only whole, aligned
//! 2 MiB pages: most matrices are smaller than that, so they are carved one after another
//! out of shared 64 MiB chunks ([`HugeBuf::zeroed`]). The packed weights are made there; float
//! matrices are copied there from the checkpoint's mapping at load. Advice only: where the
//! kernel says no, the memory is ordinary pages; elsewhere than Linux, a plain vector (and a
//! float matrix stays where the checkpoint holds it).

use std::ops::{Deref, DerefMut};
#[cfg(target_os = "linux")]
use std::sync::{Arc, Mutex, Weak};

/// Bytes of a huge page, and the alignment of a chunk.
const HUGE: usize = 2 << 20;
/// Bytes of a shared chunk (a larger request gets a chunk of its own).
const CHUNK: usize = 64 << 20;
/// Requests below this take an ordinary vector: not worth a place in a chunk.
const SMALL: usize = 64 << 10;
/// Alignment of every buffer carved from a chunk (a cache line).
const ALIGN: usize = 64;

/// A zeroed byte buffer, in huge pages where the system gives them.
pub enum HugeBuf {
    Heap(Vec<u8>),
    #[cfg(target_os = "linux")]
    Carved {
        chunk: Arc<Chunk>,
        start: usize,
        len: usize,
    },
}

impl HugeBuf {
    /// `len` zero bytes carved from a huge-page chunk; `None` where that is not worth it (a
    /// small buffer) or not possible (not Linux, or the mapping failed).
    pub fn zeroed_huge_only(len: usize) -> Option<HugeBuf> {
        #[cfg(target_os = "linux")]
        if len >= SMALL {
            if let Some((chunk, start)) = carve(len) {
                return Some(HugeBuf::Carved { chunk, start, len });
            }
        }
        let _ = len;
        None
    }

    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> HugeBuf {
        HugeBuf::zeroed_huge_only(len).unwrap_or_else(|| HugeBuf::Heap(vec![0u8; len]))
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            HugeBuf::Heap(v) => v,
            #[cfg(target_os = "linux")]
            // SAFETY: [start, start + len) lies inside the chunk's mapping, which lives as long
            // as `chunk`, and no other buffer overlaps it (carve hands out disjoint ranges).
            HugeBuf::Carved { chunk, start, len } => unsafe {
                std::slice::from_raw_parts(chunk.base.add(*start), *len)
            },
        }
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            HugeBuf::Heap(v) => v,
            #[cfg(target_os = "linux")]
            // SAFETY: as in `deref`; `&mut self` makes this the only reference to the range.
            HugeBuf::Carved { chunk, start, len } => unsafe {
                std::slice::from_raw_parts_mut(chunk.base.add(*start), *len)
            },
        }
    }
}

/// An anonymous mapping, its usable part 2 MiB-aligned and advised to be huge.
#[cfg(target_os = "linux")]
pub struct Chunk {
    map: *mut libc::c_void,
    map_len: usize,
    base: *mut u8,
    len: usize,
}

// SAFETY: a chunk is plain memory; the buffers carved from it are disjoint, each reached only
// through its own HugeBuf (shared reads, or one writer by `&mut`).
#[cfg(target_os = "linux")]
unsafe impl Send for Chunk {}
#[cfg(target_os = "linux")]
unsafe impl Sync for Chunk {}

#[cfg(target_os = "linux")]
impl Chunk {
    fn new(len: usize) -> Option<Chunk> {
        let map_len = len + HUGE;
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        let base = (map as usize).next_multiple_of(HUGE) as *mut u8;
        // SAFETY: [base, base + len) lies inside the mapping; the advice changes how its pages
        // are backed, never their (zero) contents, and its failure is harmless.
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        Some(Chunk { map, map_len, base, len })
    }
}

#[cfg(target_os = "linux")]
impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once, after every buffer carved from it
        // (each holds the Arc) is gone.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// The chunk being carved and the next free offset in it. Held weakly: a chunk is unmapped
/// once every buffer carved from it is gone (a dropped model gives its memory back), and the
/// next request then starts a new one.
#[cfg(target_os = "linux")]
static CURRENT: Mutex<Option<(Weak<Chunk>, usize)>> = Mutex::new(None);

/// A range of `len` bytes from the current chunk, or from a new one.
#[cfg(target_os = "linux")]
fn carve(len: usize) -> Option<(Arc<Chunk>, usize)> {
    let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((weak, next)) = current.as_mut() {
        if let Some(chunk) = weak.upgrade().filter(|c| *next + len <= c.len) {
            let start = *next;
            *next = (start + len).next_multiple_of(ALIGN);
            return Some((chunk, start));
        }
    }
    if len >= CHUNK {
        // A chunk of its own; the current one keeps its room for the next.
        return Some((Arc::new(Chunk::new(len.next_multiple_of(HUGE))?), 0));
    }
    let chunk = Arc::new(Chunk::new(CHUNK)?);
    *current = Some((Arc::downgrade(&chunk), len.next_multiple_of(ALIGN)));
    Some((chunk, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_disjoint_and_writable() {
        let sizes = [10usize, SMALL, 3 << 20, 100 << 10, CHUNK + 5, 7 << 20];
        let mut bufs: Vec<HugeBuf> = sizes.iter().map(|&n| HugeBuf::zeroed(n)).collect();
        for (k, (b, &n)) in bufs.iter_mut().zip(&sizes).enumerate() {
            assert_eq!(b.len(), n);
            assert!(b.iter().all(|&v| v == 0), "buffer {k} is not zeroed");
            b.fill(k as u8 + 1);
        }
        for (k, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&v| v == k as u8 + 1), "buffer {k} was overwritten by another");
        }
        // Once every buffer of a chunk is gone, new ones are zeroed again.
        drop(bufs);
        let again = HugeBuf::zeroed(3 << 20);
        assert!(again.iter().all(|&v| v == 0), "a buffer after the drop is not zeroed");
    }
}
