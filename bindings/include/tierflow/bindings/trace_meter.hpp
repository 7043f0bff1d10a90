// A runtime's meters in the trace: its bytes per tier as the trace's counter (Note [Trace] in core/trace.hpp).
#pragma once

namespace tierflow::bindings {

class Runtime;

/// Attaches `runtime`'s meters (device activations held, pinned host pool in use, NVMe in use) to the trace,
/// with its TIERFLOW_TRACE path (recording from now on when one is given); trace::detach(&runtime) ends it.
void attach_trace(Runtime& runtime);

}  // namespace tierflow::bindings
