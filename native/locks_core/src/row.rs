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
        let yes =
            cell(self, i, "boolean", |v| if let Value::Bool(b) = v { Some(*b) } else { None });
        yes?.ok_or_else(|| not_a("boolean", i, &Value::Null))
    }

    fn text(&self, i: usize) -> Result<Option<&str>> {
        cell(self, i, "string", |v| if let Value::Text(t) = v { Some(t.as_str()) } else { None })
    }

    fn int(&self, i: usize) -> Result<Option<i64>> {
        cell(self, i, "integer", |v| if let Value::Int(n) = v { Some(*n) } else { None })
    }

    fn float(&self, i: usize) -> Result<Option<f64>> {
        cell(self, i, "float", |v| if let Value::Float(x) = v { Some(*x) } else { None })
    }
}

/// Column `i` of `row` as `pick` reads it (`None` for NULL), or why not:
/// no such column, or a value `pick` does not take (not an `expected`).
fn cell<'a, T>(
    row: &'a [Value],
    i: usize,
    expected: &str,
    pick: impl FnOnce(&'a Value) -> Option<T>,
) -> Result<Option<T>> {
    match row.get(i) {
        None => Err(Error::unexpected(format!("no column {i}"))),
        Some(Value::Null) => Ok(None),
        Some(value) => pick(value).map(Some).ok_or_else(|| not_a(expected, i, value)),
    }
}

/// Column `i` holds `value`, which is not an `expected`.
fn not_a(expected: &str, i: usize, value: &Value) -> Error {
    Error::unexpected(format!("column {i} is {value:?}, not a {expected}"))
}

/// The only row of a statement that returns exactly one.
pub(crate) fn only<R>(rows: &[R]) -> Result<&R> {
    match rows {
        [row] => Ok(row),
        _ => Err(Error::unexpected(format!("{} rows where one was expected", rows.len()))),
    }
}
