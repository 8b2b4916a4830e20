defmodule PhoenixKitAgent.Turns.DocsTest do
  # The README's and the guides' tables against the code's own lists, each
  # defined once: the public functions (Locks, whose lock functions are the
  # native Job's, Native.functions/0), the error reasons (Locks.Error's
  # list, which its type is made from), the settings (Config's list, as its unknown-setting error names
  # it) and the row wait (ROW_WAIT, Native.rules/0). A table that drifts
  # from its list fails here; so does a link that leads nowhere.
  use ExUnit.Case, async: true

  alias PhoenixKitAgent.Turns.Locks
  alias PhoenixKitAgent.Turns.Locks.{Config, Native}

  @readme File.read!("README.md")
  @guides Path.wildcard("guides/*.md")

  # The first column of the Markdown table whose header row starts with `header`.
  defp column(text, header) do
    [_, table] = String.split(text, "\n| #{header} |", parts: 2)

    table
    |> String.split("\n")
    |> Enum.drop(2)
    |> Enum.take_while(&String.starts_with?(&1, "|"))
    |> Enum.map(&(&1 |> String.split("|") |> Enum.at(1) |> String.trim()))
  end

  defp documented_functions do
    {:docs_v1, _, _, _, _, _, docs} = Code.fetch_docs(Locks)
    for {{:function, name, arity}, _, _, doc, _} <- docs, doc != :hidden, do: {name, arity}
  end

  test "the README's API table lists each public function of Locks once, with its arity" do
    listed =
      for cell <- column(@readme, "function") do
        [_, name, args] = Regex.run(~r/^`(\w+[?!]?)\((.*)\)`$/, cell)
        {String.to_atom(name), if(args == "", do: 0, else: length(String.split(args, ",")))}
      end

    assert Enum.sort(listed) == Enum.sort(documented_functions())
    # The lock functions, the native side's one list (Job), are among them.
    for name <- Native.functions(),
        do: assert(Enum.any?(listed, &(elem(&1, 0) == name)), "#{name} is not listed")
  end

  test "the README's error table lists each reason of Locks.Error once" do
    reasons = Locks.Error.reasons()

    # The type is made from the same list.
    {:ok, types} = Code.Typespec.fetch_types(Locks.Error)
    [union] = for {:type, {:reason, {:type, _, :union, atoms}, []}} <- types, do: atoms
    assert for({:atom, _, reason} <- union, do: reason) == reasons

    listed =
      for "`:" <> rest <- column(@readme, "reason"), do: String.to_atom(String.trim(rest, "`"))

    assert Enum.sort(listed) == Enum.sort(reasons)
    {:docs_v1, _, _, _, %{"en" => doc}, _, _} = Code.fetch_docs(Locks.Error)
    for reason <- reasons, do: assert(doc =~ "`#{inspect(reason)}`", "#{reason} undocumented")
  end

  test "the settings table of the operating guide lists every setting once, as Config knows them" do
    {:error, error} =
      try do
        {:ok, Config.read([urll: "x"], [])}
      rescue
        error -> {:error, error}
      end

    [_, names] = Regex.run(~r/the settings are (.*)$/, Exception.message(error))
    settings = for ":" <> name <- String.split(names, ", "), do: name
    listed = "guides/operating.md" |> File.read!() |> column("setting")
    listed = Enum.flat_map(listed, &Regex.scan(~r/`(\w+)`/, &1, capture: :all_but_first))

    assert Enum.sort(List.flatten(listed)) == Enum.sort(settings ++ ["build_from_source"])
  end

  test "the docs state the row wait the statements use (ROW_WAIT, sql.rs)" do
    wait = "#{Native.rules().row_wait_ms} ms"
    {:docs_v1, _, _, _, %{"en" => error_doc}, _, _} = Code.fetch_docs(Locks.Error)
    {:docs_v1, _, _, _, %{"en" => locks_doc}, _, _} = Code.fetch_docs(Locks)
    operating = File.read!("guides/operating.md")

    for {name, text} <- [
          README: @readme,
          operating: operating,
          Error: error_doc,
          Locks: locks_doc
        ] do
      assert text =~ "after #{wait}", "#{name} does not say #{wait}"
    end
  end

  test "every relative link of the README and the guides leads to a file, and an anchor to a heading" do
    for file <- ["README.md" | @guides],
        [_, target] <- Regex.scan(~r/\]\(([^)\s]+)\)/, File.read!(file)),
        not String.match?(target, ~r/^[a-z]+:/) do
      [path | anchor] = String.split(target, "#", parts: 2)
      path = if path == "", do: file, else: Path.join(Path.dirname(file), path)
      assert File.exists?(path), "#{file}: #{target} leads nowhere"

      for anchor <- anchor do
        anchors =
          for [_, heading] <- Regex.scan(~r/^#+ (.+)$/m, File.read!(path)),
              do:
                heading
                |> String.downcase()
                |> String.replace(~r/[^\w\- ]/u, "")
                |> String.replace(" ", "-")

        assert anchor in anchors, "#{file}: #{target}: no such heading"
      end
    end
  end
end
