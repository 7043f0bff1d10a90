// The statistics report's table (tierflow.report()'s str): peak bytes per tier, bytes per link, saved tensors,
// prefetch, the CPU optimizer and its gradient stream, the blocks not recomputed; from the report's JSON (the
// runtime's stats with what the session added: the optimizer's states, partition, overlap and stream, the
// parameters, the activation plan).
#pragma once

#include <string>

namespace tierflow::tiering {

/// "1536 B", "1.50 KiB", ... "2.00 TiB": bytes as the report prints them (whole bytes below 1 KiB, truncated).
std::string report_bytes(double bytes);

/// The report's table, one row a line after "tierflow report", values aligned past the longest label.
/// `report_json`: the report as Python's json.dumps writes it (NaN and Infinity read as null: printed "nan").
/// Throws std::exception for text that is not such a report.
std::string report_text(const std::string& report_json);

}  // namespace tierflow::tiering
