//! legion-planner: machine model, parallel configurations, cost model and strategy searches.
//! (Issue 3 fills this crate; it depends only on `legion-ops`.)
