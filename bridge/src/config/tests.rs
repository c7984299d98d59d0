//! The configuration's rules, its documentation and its examples, tested.

use super::*;

/// A parsed file whose build succeeded (the topology is dropped: these
/// tests are about the rules).
fn built(config: Result<BridgeConfig, ConfigError>) -> Result<BridgeConfig, ConfigError> {
    let config = config?;
    crate::blueprint::Blueprint::build(config.clone())?;
    Ok(config)
}

fn parse_built(
    text: &str,
    origin: &str,
    env: &[(String, String)],
) -> Result<BridgeConfig, ConfigError> {
    built(BridgeConfig::parse(text, origin, env))
}

mod rules {
    use super::*;

    /// Parsed and built, as `run` and `check-config` do.
    fn parse(text: &str) -> Result<BridgeConfig, ConfigError> {
        built(BridgeConfig::parse(text, "test.toml", &[]))
    }

    const MINIMAL: &str = r#"
        [adapters]
        local = "local:./data"
        [[sources]]
        name = "calls"
        adapter = "local"
        queue = "calls"
        [[routes]]
        name = "all"
        sink = "local"
    "#;

    #[test]
    fn the_embedded_default_is_valid_and_documented_values_hold() {
        let c = built(BridgeConfig::embedded_default(&[])).unwrap();
        assert_eq!(c.http.listen, "127.0.0.1:9464");
        assert_eq!(
            c.adapters.get("local").map(|a| a.url.as_str()),
            Some("local:./ojs-bridge-data")
        );
        assert_eq!(c.sources[0].queue, "calls");
        assert_eq!(c.sources[0].format, InputFormat::Grpcq);
        assert_eq!(c.routes[0].queue.as_deref(), Some("default"));
        assert_eq!(c.routes[0].job_type.as_deref(), Some("{topic}.{action}"));
        assert_eq!(c.shutdown_timeout, Duration::from_secs(30));
    }

    #[test]
    fn defaults_fill_what_a_file_leaves_out() {
        let c = parse(MINIMAL).unwrap();
        let s = &c.sources[0];
        assert_eq!(
            (s.batch_size, s.max_in_flight, s.group.as_str()),
            (256, 2048, "ojs-bridge")
        );
        assert_eq!(s.visibility_timeout, Duration::from_secs(60));
        assert_eq!(c.routes[0].to, OutputFormat::Ojs);
        assert_eq!(c.routes[0].encoding, EnvelopeEncoding::Proto);
    }

    #[test]
    fn worker_threads_from_the_file_or_the_environment_and_never_zero() {
        assert_eq!(parse(MINIMAL).unwrap().worker_threads, None);
        let file = format!("worker_threads = 1\n{MINIMAL}");
        assert_eq!(parse(&file).unwrap().worker_threads, Some(1));
        let env = |v: &str| vec![("OJS_BRIDGE_WORKER_THREADS".to_owned(), v.to_owned())];
        let c = parse_built(&file, "t", &env("3")).unwrap();
        assert_eq!(c.worker_threads, Some(3), "the environment wins");
        for bad in ["0", "two"] {
            match parse_built(MINIMAL, "t", &env(bad)) {
                Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "worker_threads"),
                other => panic!("{bad}: expected worker_threads refused, got {other:?}"),
            }
        }
    }

    #[test]
    fn the_runtime_leaves_a_cpu_to_librdkafka_when_an_adapter_is_kafka() {
        let without_kafka = parse(MINIMAL).unwrap();
        assert_eq!(without_kafka.runtime_threads(2), 2);
        assert_eq!(without_kafka.runtime_threads(8), 8);
        assert_eq!(without_kafka.runtime_threads(0), 1);
        let kafka = format!(
            "{}\n[adapters.events]\nurl = \"kafka://127.0.0.1:9092\"\n",
            MINIMAL.replace("[adapters]\n", "[adapters]\nbus = \"memory://bus\"\n")
        );
        let with_kafka = parse(&kafka).unwrap();
        assert_eq!(with_kafka.runtime_threads(2), 1);
        assert_eq!(with_kafka.runtime_threads(8), 7);
        assert_eq!(with_kafka.runtime_threads(1), 1, "never none");
        let set = parse(&format!("worker_threads = 2\n{kafka}")).unwrap();
        assert_eq!(set.runtime_threads(2), 2, "a setting wins");
        assert_eq!(set.runtime_threads(16), 2);
    }

    #[test]
    fn environment_overrides_listen_timeout_and_adapter_urls() {
        let env = vec![
            (
                "OJS_BRIDGE_HTTP_LISTEN".to_owned(),
                "127.0.0.1:19464".to_owned(),
            ),
            ("OJS_BRIDGE_SHUTDOWN_TIMEOUT".to_owned(), "5s".to_owned()),
            (
                "OJS_BRIDGE_ADAPTER_LOCAL".to_owned(),
                "local:./elsewhere".to_owned(),
            ),
            ("OJS_BRIDGE_LOG".to_owned(), "debug".to_owned()),
            ("PATH".to_owned(), "/bin".to_owned()),
        ];
        let c = parse_built(MINIMAL, "t", &env).unwrap();
        assert_eq!(c.http.listen, "127.0.0.1:19464");
        assert_eq!(c.shutdown_timeout, Duration::from_secs(5));
        assert_eq!(
            c.adapters.get("local").map(|a| a.url.as_str()),
            Some("local:./elsewhere")
        );
        assert_eq!(c.adapters.len(), 1);
    }

    /// The `[api]` settings a configuration text builds.
    fn api_settings(text: &str) -> ojs_api::ApiSettings {
        let c = parse_built(text, "t", &[]).unwrap();
        c.api
            .as_ref()
            .unwrap()
            .settings(&c.adapters, &c.http)
            .unwrap()
    }

    #[test]
    fn the_api_table_is_checked_and_may_stand_alone() {
        let alone = "[adapters]\nrabbit = \"amqp://u:p@127.0.0.1:5672/%2f\"\n[api]\nadapter = \"rabbit\"\nqueues = [\"orders\", \"mail.*\"]\n";
        let c = parse_built(alone, "t", &[]).unwrap();
        let api = c.api.as_ref().unwrap();
        assert!(c.sources.is_empty() && c.routes.is_empty());
        let settings = api.settings(&c.adapters, &c.http).unwrap();
        assert!(settings.queues.iter().any(|g| g.matches("mail.eu")));
        assert!(!settings.queues.iter().any(|g| g.matches("payroll")));
        assert_eq!(settings.state_dir, PathBuf::from("./ojs-bridge-data"));
        assert_eq!(settings.max_batch_jobs, 1000);
        assert_eq!(settings.max_crons, 1000);
        let crons =
            "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\nmax_crons = 5\n";
        let settings = api_settings(crons);
        assert_eq!(settings.max_crons, 5);
        let too_many = crons.replace("max_crons = 5", "max_crons = 100001");
        let text = parse_built(&too_many, "t", &[]).unwrap_err().to_string();
        assert!(text.contains("api.max_crons"), "{text}");
        let steps = crons.replace("max_crons = 5", "max_workflow_steps = 3");
        let settings = api_settings(&steps);
        assert_eq!(settings.max_workflow_steps, 3);
        let none = crons.replace("max_crons = 5", "max_workflow_steps = 0");
        let text = parse_built(&none, "t", &[]).unwrap_err().to_string();
        assert!(text.contains("api.max_workflow_steps"), "{text}");
        // The live streams, parent results and the reset: taken, and
        // refused out of bounds naming the field.
        let set = crons.replace(
            "max_crons = 5",
            "max_event_streams = 7\nmax_parent_results_bytes = 2048\nallow_reset = true\nmax_held_bytes = 1048576",
        );
        let settings = api_settings(&set);
        assert_eq!(settings.max_held_bytes, 1 << 20);
        assert_eq!(api_settings(crons).max_held_bytes, 256 << 20, "the default");
        assert_eq!(settings.max_event_streams, 7);
        assert_eq!(settings.max_parent_results_bytes, 2048);
        assert!(settings.allow_reset);
        let defaults = api_settings(crons);
        assert!(!defaults.allow_reset, "a reset is refused unless enabled");
        assert_eq!(defaults.ack_linger, Duration::from_millis(2));
        for (line, linger) in [
            ("ack_linger = \"0ms\"", Duration::ZERO),
            ("ack_linger = \"1s\"", Duration::from_secs(1)),
        ] {
            let set = crons.replace("max_crons = 5", line);
            assert_eq!(api_settings(&set).ack_linger, linger, "{line}");
        }
        for (line, field) in [
            ("max_event_streams = 0", "api.max_event_streams"),
            ("max_event_streams = 100001", "api.max_event_streams"),
            (
                "max_parent_results_bytes = 67108865",
                "api.max_parent_results_bytes",
            ),
            ("allow_reset = \"yes\"", "allow_reset"),
            ("max_held_bytes = 1023", "api.max_held_bytes"),
            ("ack_linger = \"1001ms\"", "api.ack_linger"),
            ("ack_linger = \"soon\"", "ack_linger"),
        ] {
            let bad = crons.replace("max_crons = 5", line);
            let text = parse_built(&bad, "t", &[]).unwrap_err().to_string();
            assert!(text.contains(field), "{line}: {text}");
        }
        // The environment names the adapter, even for a file without [api].
        let env = vec![("OJS_BRIDGE_API_ADAPTER".to_owned(), "local".to_owned())];
        let c = parse_built(MINIMAL, "t", &env).unwrap();
        assert_eq!(c.api.map(|a| a.adapter), Some("local".to_owned()));
        let bad = "[adapters]\nrabbit = \"amqp://127.0.0.1\"\n[api]\nadapter = \"rabit\"\nqueues = [\"\", \"Bad Queue\"]\nstate = \"redis://db/ojs\"\nmax_batch_jobs = 0\nmax_body_bytes = 10\n";
        let err = parse_built(bad, "t", &[]).unwrap_err();
        let ConfigError::Several(problems) = &err else {
            panic!("expected every problem, got {err}");
        };
        let text = err.to_string();
        for field in [
            "api.adapter",
            "api.queues[0]",
            "api.queues[1]",
            "api.state",
            "api.max_batch_jobs",
            "api.max_body_bytes",
        ] {
            assert!(text.contains(field), "{field} missing from {text}");
        }
        assert!(problems.len() >= 6);
        assert!(text.contains("did you mean `rabbit`"), "{text}");
        // PostgreSQL's settings, each named by its own field.
        let pg = "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\nstate = \"postgres://u@db:5432/jobs\"\nstate_schema = \"Bad-Schema\"\nstate_connections = 0\n";
        let text = parse_built(pg, "t", &[]).unwrap_err().to_string();
        assert!(text.contains("api.state_schema"), "{text}");
        assert!(text.contains("api.state_connections"), "{text}");
        let pg = "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\nstate = \"postgres://u@db:notaport/jobs\"\n";
        let text = parse_built(pg, "t", &[]).unwrap_err().to_string();
        assert!(text.contains("api.state"), "{text}");
        let local_with_password = "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\nstate_password_file = \"/run/pg\"\n";
        let text = parse_built(local_with_password, "t", &[])
            .unwrap_err()
            .to_string();
        assert!(text.contains("api.state_password_file"), "{text}");
        let good = "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\nstate = \"postgres://u@db:5432/jobs\"\nstate_schema = \"ojs_a1\"\n";
        let settings = parse_built(good, "t", &[])
            .unwrap()
            .api
            .unwrap()
            .settings(
                &BTreeMap::from([("local".to_owned(), AdapterEntry::url("local:./d"))]),
                &HttpConfig::default(),
            )
            .unwrap();
        assert_eq!(settings.drain_timeout, std::time::Duration::from_secs(10));
        let pg = settings.postgres.expect("a PostgreSQL store");
        assert_eq!((pg.schema.as_str(), pg.connections), ("ojs_a1", 8));
        let bad_drain = "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\ndrain_timeout = \"ten\"\n";
        let text = parse_built(bad_drain, "t", &[]).unwrap_err().to_string();
        assert!(
            text.contains("drain_timeout") && text.contains("not a duration"),
            "{text}"
        );
        // The URL (password included) from the environment.
        let env = vec![(
            "OJS_BRIDGE_API_STATE".to_owned(),
            "postgres://u:pw@db:5432/from_env".to_owned(),
        )];
        let c = parse_built(
            "[adapters]\nlocal = \"local:./d\"\n[api]\nadapter = \"local\"\n",
            "t",
            &env,
        )
        .unwrap();
        let state = c.api.and_then(|a| a.state).map(|s| s.0);
        assert_eq!(state.as_deref(), Some("postgres://u:pw@db:5432/from_env"));
        let unknown = parse_built("[api]\nadapter = \"a\"\nqueus = []\n", "t", &[]).unwrap_err();
        assert!(unknown.to_string().contains("queus"), "{unknown}");
    }

    fn error_of(text: &str) -> String {
        parse(text).unwrap_err().to_string()
    }

    #[test]
    fn a_file_is_refused_with_every_problem_in_it() {
        let text = MINIMAL
            .replace("queue = \"calls\"", "queue = \"\"\nbatch_size = 0")
            .replace("sink = \"local\"", "sink = \"nope\"");
        let err = parse(&text).unwrap_err();
        let ConfigError::Several(problems) = &err else {
            panic!("expected every problem, got {err}");
        };
        let fields: Vec<String> = problems
            .iter()
            .map(|p| match p {
                ConfigError::Invalid { field, .. } => field.clone(),
                other => other.to_string(),
            })
            .collect();
        assert_eq!(
            fields,
            [
                "sources[0].queue",
                "sources[0].batch_size",
                "routes[0].sink"
            ],
            "{err}"
        );
        let text = err.to_string();
        assert!(text.starts_with("3 problems:\n"), "{text}");
        assert_eq!(text.lines().count(), 4, "one line each: {text}");
    }

    #[test]
    fn a_route_is_refused_with_every_rule_it_breaks_in_file_order() {
        // One build holds every rule: the source's, the route's references
        // and what the route itself compiles (templates, type text,
        // bounds), all reported at once.
        let text = MINIMAL
            .replace("queue = \"calls\"", "queue = \"calls\"\nbatch_size = 0")
            .replace(
                "sink = \"local\"",
                "sink = \"local\"\nsources = [\"x\"]\ntype = \"Billing.{action}\"\ntopic = \"{nope}\"\nmax_destinations = 0\nmessage_type = \"a.B\"",
            );
        let err = parse(&text).unwrap_err();
        let ConfigError::Several(problems) = &err else {
            panic!("expected every problem, got {err}");
        };
        let fields: Vec<&str> = problems
            .iter()
            .map(|p| match p {
                ConfigError::Invalid { field, .. } => field.as_str(),
                _ => "",
            })
            .collect();
        assert_eq!(
            fields,
            [
                "sources[0].batch_size",
                "routes[0].sources[0]",
                "routes[0].topic",
                "routes[0].type",
                "routes[0].max_destinations",
                "routes[0].message_type"
            ],
            "{err}"
        );
    }

    #[test]
    fn near_misses_get_a_did_you_mean() {
        let text = error_of(&MINIMAL.replace("[[sources]]", "[[sourcs]]"));
        assert!(text.contains("did you mean `sources`?"), "{text}");
        let text = error_of(&MINIMAL.replace(
            "queue = \"calls\"",
            "queue = \"calls\"\nvisibility_timout = \"1s\"",
        ));
        assert!(
            text.contains("did you mean `visibility_timeout`?"),
            "{text}"
        );
        let text = error_of(&MINIMAL.replace("sink = \"local\"", "sink = \"locla\""));
        assert!(text.contains("did you mean `local`?"), "{text}");
        assert_eq!(
            suggest_known_field("unknown field `zzz`, expected `a`".into()),
            "unknown field `zzz`, expected `a`"
        );
    }

    #[test]
    fn each_bad_file_names_what_to_fix() {
        let cases: &[(&str, &str)] = &[
            ("adapters = [", "test.toml"),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nbatch = 3"),
                "unknown field `batch`",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"kafak\""),
                "routes[0].sink: names adapter \"kafak\"",
            ),
            (
                &MINIMAL.replace("adapter = \"local\"", "adapter = \"nope\""),
                "sources[0].adapter",
            ),
            (
                &MINIMAL.replace("local:./data", "ftp://x"),
                "adapters.local",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nbatch_size = 0"),
                "sources[0].batch_size",
            ),
            (
                &MINIMAL.replace(
                    "queue = \"calls\"",
                    "queue = \"calls\"\nmax_in_flight = 2\nbatch_size = 10",
                ),
                "sources[0].max_in_flight",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nmax_in_flight_bytes = 0"),
                "sources[0].max_in_flight_bytes",
            ),
            (
                &MINIMAL.replace(
                    "queue = \"calls\"",
                    "queue = \"calls\"\nordering = \"per_key\"\nlanes = 0",
                ),
                "sources[0].lanes",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nlanes = 4"),
                "sources[0].lanes",
            ),
            (
                &MINIMAL.replace("queue = \"calls\"", "queue = \"calls\"\nordering = \"by_key\""),
                "ordering",
            ),
            (
                &MINIMAL.replace(
                    "queue = \"calls\"",
                    "queue = \"calls\"\nvisibility_timeout = \"ten\"",
                ),
                "not a duration",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"local\"\ntype = \"{topik}\""),
                "routes[0].type",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"local\"\nsources = [\"x\"]"),
                "routes[0].sources[0]",
            ),
            (
                &MINIMAL.replace(
                    "sink = \"local\"",
                    "sink = \"local\"\nmatch = { type = \"a\", topic = \"b\" }",
                ),
                "routes[0].match",
            ),
            (
                &MINIMAL.replace(
                    "sink = \"local\"",
                    "sink = \"local\"\nmessage_type = \"a.B\"",
                ),
                "needs descriptor_set",
            ),
            (
                &MINIMAL.replace("sink = \"local\"", "sink = \"local\"\nto = \"xml\""),
                "unknown variant `xml`",
            ),
            (
                &format!("{MINIMAL}\n[http]\nlisten = \"everywhere\""),
                "http.listen",
            ),
            (
                &format!("{MINIMAL}\n[[routes]]\nname = \"all\"\nsink = \"local\""),
                "routes[1].name",
            ),
            (
                &MINIMAL.replace(
                    "[[routes]]\n        name = \"all\"\n        sink = \"local\"",
                    "",
                ),
                "routes: no route",
            ),
            (
                &format!("{MINIMAL}\n[federations.g]\nlocal = \"eu\"\n[federations.g.regions.us]\nadapter = \"local\""),
                "federations.g.local",
            ),
            (
                &format!("{MINIMAL}\n[federations.g]\nlocal = \"us\"\n[federations.g.regions.us]\nadapter = \"nope\""),
                "federations.g.regions.us.adapter",
            ),
            (
                &format!("{MINIMAL}\n[federations.g]\nlocal = \"us\"\n[federations.g.regions.us]\nadapter = \"local\"\nhealth = \"https://x\""),
                "federations.g.regions.us.health",
            ),
        ];
        for (text, expected) in cases {
            let e = error_of(text);
            assert!(e.contains(expected), "expected {expected:?} in {e:?}");
        }
    }

    #[test]
    fn durations_parse_in_every_documented_unit() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("5d").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("").is_err());
    }
}

mod documented_settings {
    use std::collections::BTreeSet;

    use super::*;
    use crate::endpoint::AdapterConfig;

    /// The setting names of each adapter's table in `docs/adapters/`.
    fn documented_settings() -> BTreeMap<&'static str, BTreeSet<String>> {
        let pages = [
            ("memory", include_str!("../../../docs/adapters/memory.md")),
            ("local", include_str!("../../../docs/adapters/local.md")),
            (
                "rabbitmq",
                include_str!("../../../docs/adapters/rabbitmq.md"),
            ),
            ("kafka", include_str!("../../../docs/adapters/kafka.md")),
            ("sqs", include_str!("../../../docs/adapters/sqs.md")),
        ];
        let mut out = BTreeMap::new();
        for (kind, section) in pages {
            let table = section
                .split("| setting | default | meaning |")
                .nth(1)
                .expect("a settings table");
            let mut names = BTreeSet::new();
            for row in table.lines().skip(2) {
                let Some(cell) = row.strip_prefix('|').and_then(|r| r.split('|').next()) else {
                    break;
                };
                // Backticked words of the first cell; `(URL …)` notes aside.
                let cell = cell.split("(URL").next().unwrap_or(cell);
                for name in cell.split('`').skip(1).step_by(2) {
                    if name.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                        names.insert(name.to_owned());
                    }
                }
            }
            names.remove("url");
            out.insert(kind, names);
        }
        out
    }

    #[test]
    fn every_dead_letter_reason_is_documented() {
        let operations = include_str!("../../../docs/operations.md");
        for kind in ojs_queue::DeadLetterKind::ALL {
            assert!(
                operations.contains(&format!("`{kind}`")),
                "docs/operations.md does not name dead-letter reason {kind}"
            );
        }
    }

    #[test]
    fn every_documented_setting_is_reachable_from_a_config_file() {
        let documented = documented_settings();
        let text = include_str!("../../../examples/all-adapter-settings.toml");
        let config = parse_built(text, "all-adapter-settings.toml", &[]).unwrap();
        let mut kinds = BTreeSet::new();
        for (name, entry) in &config.adapters {
            let compiled = entry.compile(name).unwrap();
            let kind = compiled.kind();
            kinds.insert(kind);
            let names = &documented[kind];
            // Its page documents exactly the settings the adapter has.
            let actual: BTreeSet<String> = AdapterConfig::setting_names(&entry.url)
                .unwrap()
                .into_iter()
                .collect();
            assert_eq!(names, &actual, "docs/adapters/{kind}.md table");
            // The file sets each of them, and each arrived (differs from
            // the default of the same URL).
            let set: BTreeSet<String> = entry.settings.keys().cloned().collect();
            assert_eq!(names, &set, "settings the example sets for {kind}");
            let base = AdapterConfig::from_url(&entry.url).unwrap();
            let as_json = |c: &AdapterConfig| {
                match c {
                    AdapterConfig::Memory { config, .. } => serde_json::to_value(config),
                    AdapterConfig::Local(c) => serde_json::to_value(c),
                    AdapterConfig::Rabbit(c) => serde_json::to_value(c),
                    AdapterConfig::Kafka(c) => serde_json::to_value(c),
                    AdapterConfig::Sqs(c) => serde_json::to_value(c),
                }
                .unwrap()
            };
            let (got, default) = (as_json(&compiled), as_json(&base));
            for setting in names {
                assert_ne!(
                    got[setting.as_str()],
                    default[setting.as_str()],
                    "{kind}.{setting} did not arrive"
                );
            }
        }
        assert_eq!(kinds.len(), documented.len(), "one adapter of each kind");
    }

    #[test]
    fn settings_come_from_urls_tables_and_the_environment_in_that_order() {
        let text = r#"
            [adapters.events]
            url = "kafka://h:9092?replication=2&partitions=4&linger.ms=5"
            replication = 3
            [adapters.rabbit]
            url = "amqp://u@h/%2f"
            [[sources]]
            name = "s"
            adapter = "rabbit"
            queue = "q"
            [[routes]]
            name = "r"
            sink = "events"
        "#;
        let env = vec![
            (
                "OJS_BRIDGE_ADAPTER_EVENTS__PARTITIONS".to_owned(),
                "8".to_owned(),
            ),
            (
                "OJS_BRIDGE_ADAPTER_EVENTS__SASL_PASSWORD".to_owned(),
                "pw-1".to_owned(),
            ),
            (
                "OJS_BRIDGE_ADAPTER_RABBIT__TOPOLOGY".to_owned(),
                "existing".to_owned(),
            ),
            (
                "OJS_BRIDGE_ADAPTER_RABBIT__QUEUE_TEMPLATE".to_owned(),
                "{queue}".to_owned(),
            ),
        ];
        let config = parse_built(text, "t", &env).unwrap();
        let AdapterConfig::Kafka(k) = config.adapters["events"].compile("events").unwrap() else {
            panic!()
        };
        assert_eq!((k.replication, k.partitions), (3, 8));
        assert_eq!(k.librdkafka_options["linger.ms"], "5");
        assert_eq!(k.librdkafka_options["sasl.password"], "pw-1");
        assert!(!format!("{:?} {k:?}", config.adapters["events"]).contains("pw-1"));
        let AdapterConfig::Rabbit(r) = config.adapters["rabbit"].compile("rabbit").unwrap() else {
            panic!()
        };
        assert_eq!(r.topology, ojs_queue::settings::Topology::Existing);
        assert_eq!(r.queue_name_of("orders"), "orders");
    }

    #[test]
    fn bad_settings_name_the_adapter_and_the_setting() {
        for (table, field) in [
            ("replication = \"many\"", "adapters.events.replication"),
            ("bogus = 1", "adapters.events.bogus"),
            ("topology = \"create\"", "adapters.events.topology"),
            ("partitions = 0", "adapters.events.partitions"),
        ] {
            let text = format!(
                "[adapters.events]\nurl = \"kafka://h:9092\"\n{table}\n[[sources]]\nname = \"s\"\nadapter = \"events\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"events\"\n"
            );
            let e = parse_built(&text, "t", &[]).unwrap_err().to_string();
            assert!(e.starts_with(field), "{table}: {e}");
        }
        let e = parse_built(
            "[adapters.x]\nqueue_template = \"{queue}\"\n[[sources]]\nname = \"s\"\nadapter = \"x\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"x\"\n",
            "t",
            &[],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("adapters.x") && e.contains("url"), "{e}");
    }
}

mod type_templates {
    use super::*;

    fn with_type(t: &str) -> Result<BridgeConfig, ConfigError> {
        built(BridgeConfig::parse(
            &format!(
                "[adapters]\nm = \"memory://x\"\n[[sources]]\nname = \"s\"\nadapter = \"m\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"m\"\ntype = \"{t}\"\n"
            ),
            "t",
            &[],
        ))
    }

    #[test]
    fn a_type_template_must_render_an_ojs_type() {
        assert!(with_type("{topic}.{action}").is_ok());
        assert!(with_type("billing.{action}").is_ok());
        assert!(with_type("billing.invoice.generate").is_ok());
        for bad in [
            "Billing.{action}",
            "billing-{action}",
            "Billing.Invoice",
            "2fa.send",
        ] {
            let e = with_type(bad).unwrap_err().to_string();
            assert!(e.starts_with("routes[0].type"), "{bad}: {e}");
        }
    }
}

mod destinations {
    use super::*;

    fn route(extra: &str) -> Result<BridgeConfig, ConfigError> {
        built(BridgeConfig::parse(
            &format!(
                "[adapters]\nm = \"memory://x\"\n[[sources]]\nname = \"s\"\nadapter = \"m\"\nqueue = \"q\"\n[[routes]]\nname = \"r\"\nsink = \"m\"\n{extra}\n"
            ),
            "t",
            &[],
        ))
    }

    #[test]
    fn a_message_chosen_destination_must_be_bounded_by_the_config() {
        // Literal, match-bounded and explicitly allowed destinations are fine.
        for ok in [
            "queue = \"jobs\"",
            "to = \"grpcq\"\nmatch = { topic = \"payment.*\" }",
            "queue = \"calls.{topic}\"\nmatch = { topic = \"payment.*\" }",
            "queue = \"{queue}\"\nallowed_queues = [\"orders\", \"billing.*\"]",
            "",
        ] {
            let c = route(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
            crate::routes::Route::build(&c.routes[0], 0, false).unwrap();
        }
        assert_eq!(
            crate::config::allowed_destinations(
                &route("queue = \"calls.{topic}\"\nmatch = { topic = \"payment.*\" }")
                    .unwrap()
                    .routes[0]
            )
            .unwrap(),
            vec!["calls.payment.*".to_owned()]
        );
        // Unbounded: grpcq output to any topic, a job's queue, the originator.
        for bad in [
            "to = \"grpcq\"",
            "queue = \"{queue}\"",
            "queue = \"x.{originator}\"\nmatch = { topic = \"a.*\" }",
        ] {
            let e = route(bad).unwrap_err().to_string();
            assert!(e.starts_with("routes[0].allowed_queues"), "{bad}: {e}");
        }
    }
}

/// The built-in default names every environment variable `run` reads,
/// so that a user who starts from it finds them all.
#[test]
fn the_built_in_default_names_every_environment_variable() {
    for name in [
        "OJS_BRIDGE_CONFIG",
        "OJS_BRIDGE_HTTP_LISTEN",
        "OJS_BRIDGE_API_ADAPTER",
        "OJS_BRIDGE_API_STATE",
        "OJS_BRIDGE_SHUTDOWN_TIMEOUT",
        "OJS_BRIDGE_WORKER_THREADS",
        "OJS_BRIDGE_WAIT_FOR_BROKERS",
        "OJS_BRIDGE_ADAPTER_<NAME>",
        "OJS_BRIDGE_ADAPTER_<NAME>__<SETTING>",
        crate::logging::FILTER_ENV,
        "OJS_BRIDGE_LOG_FORMAT",
    ] {
        assert!(
            EMBEDDED_DEFAULT.contains(name),
            "examples/embedded.toml does not name {name}"
        );
    }
}

/// A typing error names the field's path and its line, not only the table
/// it is in.
#[test]
fn a_misspelled_field_is_named_by_its_path_and_line() {
    let text = "[adapters]\nlocal = \"local:./d\"\n\n[[sources]]\nname = \"a\"\nadapter = \"local\"\nqueue = \"q1\"\n\n[[sources]]\nname = \"b\"\nadapter = \"local\"\nqueue = \"q2\"\nformt = \"ojs\"\n";
    let e = BridgeConfig::parse(text, "b.toml", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("sources[1].formt (line 13)"), "{e}");
    assert!(e.contains("did you mean `format`"), "{e}");
    // An override from the environment has a path but no line.
    let env = vec![("OJS_BRIDGE_SHUTDOWN_TIMEOUT".to_owned(), "soon".to_owned())];
    let e = BridgeConfig::parse("", "b.toml", &env)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shutdown_timeout: "), "{e}");
    assert!(!e.contains("line"), "{e}");
}
