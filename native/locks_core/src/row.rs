//! The rows a statement answered, as [`Job::answer`](crate::Job) and the
//! tables' check read them: rows of [`Value`]s, whether from a pooled
//! connection (tokio-postgres' rows, read by [`values`]) or from the host's
//! repo (in `testing: :sandbox`, decoded from Elixir terms by the NIF). So one
//! piece of code turns either into the same answers, and a repo's answer is
//! checked as strictly as a connection's: a column of another type is an
//! error, never a guess.

use tokio_postgres::types::Type;

use crate::error::{Error, Result};

/// Column `i` of one row, by the types the statements of `sql.rs` return.
pub trait Row {
    /// A `boolean` column that is never NULL.
    fn bool(&self, i: usize) -> Result<bool>;
    /// A `text` column; `None` for NULL.
    fn text(&self, i: usize) -> Result<Option<&str>>;
    /// An `int8` column; `None` for NULL.
    fn int(&self, i: usize) -> Result<Option<i64>>;
    /// A `float8` column; `None` for NULL.
    fn float(&self, i: usize) -> Result<Option<f64>>;

    /// A `text` column that is never NULL.
    fn str(&self, i: usize) -> Result<&str> {
        self.text(i)?.ok_or_else(|| Error::unexpected(format!("column {i} is NULL")))
    }
}

/// One column of a row: of a pooled connection's, by its type; of the host's
/// repo's, as Postgrex decodes it (`nil`, a boolean, an integer, a float, a
/// string). Anything else is `Other`, named, which no column a lock statement
/// reads can be.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // the variants: the types and terms they come from
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Text(String),
    Other(String),
}

/// A pooled connection's row, each column read by its type.
pub(crate) fn values(row: &tokio_postgres::Row) -> Result<Vec<Value>> {
    let read = |i, column: &tokio_postgres::Column| match *column.type_() {
        Type::BOOL => row.try_get(i).map(|v: Option<_>| v.map(Value::Bool)),
        Type::INT8 => row.try_get(i).map(|v: Option<_>| v.map(Value::Int)),
        Type::FLOAT8 => row.try_get(i).map(|v: Option<_>| v.map(Value::Float)),
        Type::TEXT | Type::VARCHAR => row.try_get(i).map(|v: Option<_>| v.map(Value::Text)),
        ref other => Ok(Some(Value::Other(other.to_string()))),
    };
    let columns = row.columns().iter().enumerate();
    columns
        .map(|(i, c)| Ok(read(i, c).map_err(Error::unexpected)?.unwrap_or(Value::Null)))
        .collect()
}

impl Row for Vec<Value> {
    fn bool(&self, i: usize) -> Result<bool> {
        match self.get(i) {
            Some(Value::Bool(yes)) => Ok(*yes),
            other => Err(not_a("boolean", i, other)),
        }
    }

    fn text(&self, i: usize) -> Result<Option<&str>> {
        match self.get(i) {
            Some(Value::Null) => Ok(None),
            Some(Value::Text(text)) => Ok(Some(text)),
            other => Err(not_a("string", i, other)),
        }
    }

    fn int(&self, i: usize) -> Result<Option<i64>> {
        match self.get(i) {
            Some(Value::Null) => Ok(None),
            Some(Value::Int(n)) => Ok(Some(*n)),
            other => Err(not_a("integer", i, other)),
        }
    }

    fn float(&self, i: usize) -> Result<Option<f64>> {
        match self.get(i) {
            Some(Value::Null) => Ok(None),
            Some(Value::Float(x)) => Ok(Some(*x)),
            other => Err(not_a("float", i, other)),
        }
    }
}

fn not_a(expected: &str, i: usize, found: Option<&Value>) -> Error {
    match found {
        Some(value) => Error::unexpected(format!("column {i} is {value:?}, not a {expected}")),
        None => Error::unexpected(format!("no column {i}")),
    }
}

/// The only row of a statement that returns exactly one.
pub(crate) fn only<R>(rows: &[R]) -> Result<&R> {
    match rows {
        [row] => Ok(row),
        _ => Err(Error::unexpected(format!("{} rows where one was expected", rows.len()))),
    }
}
