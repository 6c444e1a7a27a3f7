//! Graph capture for cudarc users: [`GraphPool`], a private pool that receives every allocation
//! of one cudarc stream capture, and [`CapturedGraph`], the cudarc `CudaGraph` together with the
//! pool whose memory it replays. May use: the core's private pools, `backend::cuda`,
//! `interop::allocator`, cudarc.
//!
//! ```no_run
//! use cuda_caching_allocator::interop::CudaAllocator;
//! use cudarc::driver::{CudaContext, sys};
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.new_stream()?;
//! let alloc = CudaAllocator::shared(0)?;
//! stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
//! let pool = alloc.capture_pool(&stream)?; // every allocation of this capture goes to `pool`
//! let tmp = alloc.alloc_zeros::<f32>(&stream, 1024)?; // captured work using cached memory
//! drop(tmp); // back to the graph's pool, never to other work
//! let graph = pool
//!     .end_capture(&stream, sys::CUgraphInstantiate_flags(0))?
//!     .expect("the capture recorded work");
//! graph.launch()?; // replays on the graph's own memory
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaStream, sys};

use super::allocator::CudaAllocator;
use super::driver_error;
use crate::{AllocError, MemPoolId, Result};

/// A private pool receiving the allocations of one stream capture (its origin stream and every
/// stream forked into it), from [`CudaAllocator::capture_pool`]. Its blocks are served only to
/// allocations of captures routed to it, never to other work.
///
/// The graph replays the pool's memory, so the pool's use is given back only together with the
/// graph: [`end_capture`](Self::end_capture) (or, for a capture ended with cudarc's own
/// `CudaStream::end_capture`, [`adopt`](Self::adopt)) returns a [`CapturedGraph`] holding both,
/// whose drop destroys the graph first and then gives the pool's use back (its memory returns to
/// the device at the next `empty_cache`). A `GraphPool` dropped without its graph keeps its use
/// (Note [Graph pools live as long as their graphs]): its memory stays with the cache until
/// [`release`](Self::release) says the graph is gone.
pub struct GraphPool {
    alloc: CudaAllocator,
    id: MemPoolId,
    /// The capture's routing is still active.
    routing: bool,
    /// Dropping gives the pool's use back: no graph can replay its memory any more (none was
    /// made, or the `CapturedGraph` holding this pool dropped its graph first).
    release_on_drop: bool,
    /// The use was given back already ([`release`](Self::release)): the drop does nothing.
    given_back: bool,
}

// Note [Graph pools live as long as their graphs]: a graph launched after its pool's memory went
// back to the cache (and, at the next `empty_cache`, to the driver) writes memory that other
// buffers own, or that is unmapped. The pool's use is therefore given back only where the
// graph is known to be gone: by `CapturedGraph`'s drop (the graph is its first field), by
// `end_capture` when the capture recorded no work or failed, and by the unsafe `release`. A pool
// dropped on its own, with a graph the program got from cudarc's `end_capture`, keeps its
// memory for the cache's life; `adopt` ties such a graph to its pool instead.

impl fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphPool")
            .field("id", &self.id)
            .field("routing", &self.routing)
            .finish()
    }
}

impl GraphPool {
    /// The pool's id.
    pub fn id(&self) -> MemPoolId {
        self.id
    }

    /// Stops routing the capture's allocations into the pool (PyTorch's `endAllocateToPool`),
    /// after the capture ended. [`end_capture`](Self::end_capture) and [`adopt`](Self::adopt) do
    /// this for you. Idempotent. It does not give the pool's use back (see the type's docs).
    ///
    /// # Errors
    /// [`AllocError::Backend`] when recording the events of frees deferred during the capture
    /// failed (the routing ended all the same).
    pub fn finish(&mut self) -> Result<()> {
        if !self.routing {
            return Ok(());
        }
        self.routing = false;
        let r = self.alloc.inner.end_allocate_to_pool(self.id);
        if !self.alloc.inner.capture_underway() {
            // Note [Drops inside a capture] in `interop::slice`: no routed capture is left.
            self.alloc
                .device()
                .with_callers_context(|| self.alloc.shells().destroy_quarantined());
        }
        r
    }

    /// Ends the capture on `stream` (cudarc's `CudaStream::end_capture`, instantiating with
    /// `flags`), stops routing into the pool, and returns the graph with this pool, or `None`
    /// when the capture recorded no work (the pool's use is then given back).
    ///
    /// # Errors
    /// The driver's error from ending the capture or instantiating the graph (the routing ends
    /// and the pool's use is given back then too), or [`finish`](Self::finish)'s.
    pub fn end_capture(
        mut self,
        stream: &Arc<CudaStream>,
        flags: sys::CUgraphInstantiate_flags,
    ) -> Result<Option<CapturedGraph>> {
        let graph = stream.end_capture(flags);
        let finished = self.finish();
        let graph = match graph {
            Ok(g) => g,
            Err(e) => {
                self.release_on_drop = true;
                return Err(driver_error("cuStreamEndCapture", e));
            }
        };
        self.release_on_drop = true;
        finished?;
        Ok(graph.map(|graph| CapturedGraph { graph, pool: self }))
    }

    /// Ties `graph`, from a capture into this pool that the program ended with cudarc's own
    /// `CudaStream::end_capture`, to the pool: stops routing (as [`finish`](Self::finish)) and
    /// returns both as one [`CapturedGraph`], which gives the pool's use back when it drops.
    ///
    /// # Errors
    /// [`finish`](Self::finish)'s (the graph is dropped, and the pool keeps its use).
    pub fn adopt(mut self, graph: CudaGraph) -> Result<CapturedGraph> {
        self.finish()?;
        self.release_on_drop = true;
        Ok(CapturedGraph { graph, pool: self })
    }

    /// Stops routing and gives the pool's use back now; at its last use, the blocks held for
    /// the pool's graphs (buffers dropped inside its captures) go back to the cache too.
    ///
    /// # Errors
    /// [`finish`](Self::finish)'s, or [`AllocError::InvalidPool`] from the core's
    /// `release_pool` (the pool's use was given back already).
    ///
    /// # Safety
    /// 1. No graph captured into this pool is launched after this call (destroy them first): its
    ///    memory goes to other buffers and, at the next `empty_cache`, back to the driver.
    pub unsafe fn release(mut self) -> Result<()> {
        let finished = self.finish();
        self.given_back = true;
        self.give_back()?;
        finished
    }

    /// Gives the pool's use back (`CudaAllocator::release_pool`: at its last use the blocks
    /// held for its graphs go back too). Called only where no graph of this handle's captures
    /// can be launched any more.
    fn give_back(&self) -> Result<()> {
        // SAFETY: every caller has established that the graphs captured through this handle are
        // gone (`CapturedGraph`'s drop after its graph, a capture that made none, or the caller
        // of the unsafe `release`).
        unsafe { self.alloc.release_pool(self.id) }
    }
}

impl Drop for GraphPool {
    fn drop(&mut self) {
        if self.given_back {
            return;
        }
        if let Err(e) = self.finish() {
            tracing::error!(target: "cuda_caching_allocator", pool = %self.id, error = %e, "ending a graph pool's routing failed");
        }
        if !self.release_on_drop {
            tracing::debug!(target: "cuda_caching_allocator", pool = %self.id, "graph pool dropped without its graph: its memory stays with the cache (GraphPool::adopt ties a graph to its pool)");
            return;
        }
        if let Err(e) = self.give_back() {
            tracing::error!(target: "cuda_caching_allocator", pool = %self.id, error = %e, "releasing a graph pool failed");
        }
    }
}

/// A captured cudarc graph together with the private pool it replays: the graph drops first,
/// then the pool gives its memory back to the cache (to the device at the next `empty_cache`).
pub struct CapturedGraph {
    // Field order is drop order: the graph goes before its memory.
    graph: CudaGraph,
    pool: GraphPool,
}

impl fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CapturedGraph")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl CapturedGraph {
    /// Launches the graph on the stream it was captured on (cudarc's `CudaGraph::launch`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn launch(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }

    /// The cudarc graph.
    pub fn graph(&self) -> &CudaGraph {
        &self.graph
    }

    /// The pool holding the graph's memory (pass it to
    /// [`CudaAllocator::capture_pool_shared`] to capture another graph into it).
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }
}

impl CudaAllocator {
    /// Opens a new private pool for the capture running on `stream` (after cudarc's
    /// `stream.begin_capture(..)`): until the returned pool's
    /// [`end_capture`](GraphPool::end_capture) (or [`finish`](GraphPool::finish)), every
    /// allocation on a stream of that capture (by the driver's capture id, so streams forked
    /// into the capture count) is served from the pool, and their frees return there. While it
    /// is open a capture is underway for the cache: see `CachingAllocator::begin_allocate_to_pool`.
    ///
    /// # Errors
    /// [`AllocError::InvalidStream`] for a stream of another context or one that is not
    /// capturing; [`AllocError::Backend`] when the capture status cannot be read.
    pub fn capture_pool(&self, stream: &Arc<CudaStream>) -> Result<GraphPool> {
        self.route_capture(stream, MemPoolId::new_graph())
    }

    /// Like [`capture_pool`](Self::capture_pool), but into the pool of an earlier capture
    /// (PyTorch's `torch.cuda.graph(..., pool=other.pool())`): the graphs share memory, so
    /// replay them in capture order and never at the same time. The returned handle holds one
    /// more use of the pool.
    ///
    /// # Errors
    /// As [`capture_pool`](Self::capture_pool); [`AllocError::InvalidPool`] when `pool` is still
    /// routing another capture.
    pub fn capture_pool_shared(
        &self,
        stream: &Arc<CudaStream>,
        pool: &GraphPool,
    ) -> Result<GraphPool> {
        self.route_capture(stream, pool.id)
    }

    fn route_capture(&self, stream: &Arc<CudaStream>, id: MemPoolId) -> Result<GraphPool> {
        let sid = self.admit(stream)?;
        let Some(capture) = self.capture_of(stream, sid)? else {
            return Err(AllocError::InvalidStream {
                stream: sid,
                source: crate::BackendError::InvalidStream {
                    stream: sid,
                    reason:
                        "it is not capturing: call CudaStream::begin_capture before capture_pool"
                            .into(),
                },
            });
        };
        self.inner.begin_allocate_to_capture(id, capture)?;
        Ok(GraphPool {
            alloc: self.clone(),
            id,
            routing: true,
            release_on_drop: false,
            given_back: false,
        })
    }
}
