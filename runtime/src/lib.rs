//! legion-runtime: regions, partitions, dependence analysis and device actors.
//! (Issue 4 fills this crate.)
