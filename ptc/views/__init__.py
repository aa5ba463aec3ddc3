"""What people read: `ptc explain`, `ptc report`, `ptc inspect`, the compile summary, the
schedule grid and tables that fit any width. Each renders a Program's decisions (or, for a
plan alone, one estimate) and never re-estimates."""
