//! Graph capture on the simulated device: capture modes, the calls CUDA would refuse during a
//! capture, and the log of those calls. May use: `backend`.

use super::Inner;
use crate::backend::StreamId;

/// The capture mode of a simulated capture (CUDA's `CUstreamCaptureMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimCaptureMode {
    /// Potentially unsafe calls are prohibited on every thread (cudarc's and PyTorch's default).
    Global,
    /// Potentially unsafe calls are prohibited on the capturing thread (the simulated device has
    /// one thread of calls, so this is checked like `Global`).
    ThreadLocal,
    /// Only calls that conflict with the capture itself are prohibited.
    Relaxed,
}

/// A call that the simulated device saw while a capture was underway and that CUDA would refuse
/// or that would invalidate the capture (see [`SimDevice::capture_violations`](super::SimDevice::capture_violations)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimCaptureViolation {
    /// The backend call.
    pub operation: &'static str,
    /// The id of the capture underway.
    pub capture: u64,
    /// The mode of that capture.
    pub mode: SimCaptureMode,
}

/// How a call behaves under capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CaptureClass {
    /// Synchronizes the device, frees or releases: illegal during any global or thread-local
    /// capture.
    Unsafe,
    /// Allocates or maps: legal when made in relaxed mode.
    Allocation,
    /// Queries or waits on an event or a stream: legal in relaxed mode when the event was not
    /// recorded in a capture still underway and the stream is not capturing; otherwise (the
    /// capture's id and mode in `capture`) illegal in any mode, as the driver refuses to query a
    /// captured event or a capturing stream.
    Query {
        capture: Option<(u64, SimCaptureMode)>,
    },
}

impl Inner {
    /// The capture still underway (id, mode) that `event` was last recorded in, if any.
    pub(super) fn event_capture(&self, event: u64) -> Option<(u64, SimCaptureMode)> {
        let id = *self.captured_events.get(&event)?;
        self.captures
            .values()
            .find(|c| c.0 == id)
            .map(|&(id, mode, _)| (id, mode))
    }

    /// The capture (id, mode) `stream` takes part in, if any.
    pub(super) fn stream_capture(&self, stream: StreamId) -> Option<(u64, SimCaptureMode)> {
        self.captures.get(&stream).map(|&(id, mode, _)| (id, mode))
    }

    /// Logs `operation` as a violation if a global or thread-local capture is underway and the
    /// call is illegal then.
    pub(super) fn capture_call(&mut self, operation: &'static str, class: CaptureClass) {
        let relaxed = self.relaxed_allocation_calls;
        match class {
            CaptureClass::Allocation | CaptureClass::Query { capture: None } if relaxed => {
                return;
            }
            CaptureClass::Query {
                capture: Some((capture, mode)),
            } => {
                // Illegal in any mode: the capture the event or stream belongs to.
                self.capture_violations.push(SimCaptureViolation {
                    operation,
                    capture,
                    mode,
                });
                return;
            }
            _ => {}
        }
        let strict = self
            .captures
            .values()
            .find(|(_, mode, _)| *mode != SimCaptureMode::Relaxed)
            .copied();
        if let Some((capture, mode, _)) = strict {
            self.capture_violations.push(SimCaptureViolation {
                operation,
                capture,
                mode,
            });
        }
    }
}
