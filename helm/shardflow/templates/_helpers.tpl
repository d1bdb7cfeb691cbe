{{- define "shardflow.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "shardflow.labels" -}}
app.kubernetes.io/name: shardflow
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "shardflow.secret" -}}
{{- .Values.connection.existingSecret | default (printf "%s-connection" (include "shardflow.name" .)) -}}
{{- end -}}

{{/* One pod spec for every process; the caller gives "component", "args" and "resources". */}}
{{- define "shardflow.pod" -}}
{{- $ := .root -}}
metadata:
  labels:
    {{- include "shardflow.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with .shard }}
    shardflow/shard: {{ . | quote }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $.Template.BasePath "/config.yaml") $ | sha256sum }}
    {{- with $.Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  terminationGracePeriodSeconds: {{ add $.Values.gracePeriodSeconds 10 }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: "{{ $.Values.image.repository }}:{{ $.Values.image.tag }}"
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      args:
        {{- toYaml .args | nindent 8 }}
      envFrom:
        - configMapRef:
            name: {{ include "shardflow.name" $ }}-config
      env:
        - name: SHARDFLOW_AMQP_URL
          valueFrom:
            secretKeyRef:
              name: {{ include "shardflow.secret" $ }}
              key: amqp-url
        - name: SHARDFLOW_REDIS_URL
          valueFrom:
            secretKeyRef:
              name: {{ include "shardflow.secret" $ }}
              key: redis-url
        {{- with $.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
  {{- with $.Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $.Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $.Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{- define "shardflow.appArgs" -}}
{{- range . }}
- --app
- {{ . }}
{{- end }}
{{- end -}}
